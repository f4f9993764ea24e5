"""``python -m experiments.glue``: the sweep of :mod:`experiments.glue.task`."""

from experiments.glue.task import main

if __name__ == "__main__":  # not when a spawned process imports this as __mp_main__
    main()
