"""``python -m experiments.nmt``: the sweep of :mod:`experiments.nmt.task`."""

from experiments.nmt.task import main

main()
