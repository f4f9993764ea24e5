"""``python -m experiments.glue``: the sweep of :mod:`experiments.glue.task`."""

from experiments.glue.task import main

main()
