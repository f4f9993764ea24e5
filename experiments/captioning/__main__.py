"""``python -m experiments.captioning``: the sweep of :mod:`experiments.captioning.task`."""

from experiments.captioning.task import main

main()
