"""``python -m experiments.gat``: the sweep of :mod:`experiments.gat.task`."""

from experiments.gat.task import main

if __name__ == "__main__":  # not when a spawned process imports this as __mp_main__
    main()
