"""``python -m experiments.vqa``: the sweep of :mod:`experiments.vqa.task`."""

from experiments.vqa.task import main

main()
