"""``python -m experiments.nmt``: the sweep of :mod:`experiments.nmt.task`."""

from experiments.nmt.task import main

if __name__ == "__main__":  # not when a spawned process imports this as __mp_main__
    main()
