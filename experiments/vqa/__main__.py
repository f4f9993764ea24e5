"""``python -m experiments.vqa``: the sweep of :mod:`experiments.vqa.task`."""

from experiments.vqa.task import main

if __name__ == "__main__":  # not when a spawned process imports this as __mp_main__
    main()
