"""``python -m experiments.captioning``: the sweep of :mod:`experiments.captioning.task`."""

from experiments.captioning.task import main

if __name__ == "__main__":  # not when a spawned process imports this as __mp_main__
    main()
