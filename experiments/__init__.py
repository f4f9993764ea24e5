"""The paper's tasks, one folder each (found by :mod:`experiments.catalog`), the runner that trains them, and the commands over all tasks."""
