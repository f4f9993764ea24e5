"""``python -m experiments.gat``: the sweep of :mod:`experiments.gat.task`."""

from experiments.gat.task import main

main()
