"""The experiment runner: every task script is a :class:`Task` handed to :func:`run_cli`.

A task provides a settings dataclass (a :class:`RunSettings` subclass) with its presets, a data
loader, and a function that trains one run and returns its metrics. The runner does the rest, once
for every task, one job per module: the declaration (:mod:`~experiments.runner.task`), the command line
(:mod:`~experiments.runner.cli`), the sweep (:mod:`~experiments.runner.sweep`), reloading finished runs
(:mod:`~experiments.runner.trained`) and the tables (:mod:`~experiments.runner.tables`). What several
tasks share besides lives here too: the epoch loop and parameter counts (:mod:`~experiments.runner.fitting`),
the benchmarks' measurements (:mod:`~experiments.runner.benchmarking`), posterior draws of an
evaluation set shared out over a run's processes (:mod:`~experiments.runner.draws`), the
uncertainty-under-shift draws and tables (:mod:`~experiments.runner.shift_draws`,
:mod:`~experiments.runner.shift_tables`). What the runner does:

- command-line options derived from the settings' fields (``--batch-size`` for ``batch_size``),
  so that a new setting is one line; a value given overrides the preset, which overrides the
  field's default;
- the sweep over panels (data sets or tasks) x seeds x variants, paired by seed;
- one record per run (:mod:`experiments.records`): finished runs are skipped, a finished or
  unfinished run asked for with other settings is refused by name, and an interrupted run resumes
  from its checkpoint (written by epoch and every ``--checkpoint-minutes``); the same command
  started in several processes shares the sweep out, each run trained by one of them (a process
  left with none ends with status 0, or with ``--wait`` waits for the others); runs a table would
  pool or pair are refused unless their settings agree, at plan time, on claiming a run and before
  the tables;
- the tables (mean ± std per variant, the paired difference to soft with its confidence
  interval, the paper's figures beside ours) as Markdown and CSV, and the paired-runs picture;
- a finished run loaded back (:func:`load_trained`): its settings from the record, its kept
  epoch's parameters from the checkpoint, for analyses after the sweep;
- user errors (an invalid setting, a missing data file, a finished run with other settings, a
  damaged record or checkpoint, an output folder that cannot be written or has no room for a
  checkpoint) end the command with one line and status 2, as argparse does, before any work, and
  so does a write that fails later (a full disk), leaving no partial file; Ctrl-C ends it with one
  line and status 130; bugs keep their traceback. Every check
  that needs no data runs before the data load: the options, the output folder, the folder's
  records and the checkpoints of the runs asked for (finished: their checksums; unfinished:
  readable and of the same settings);
- devices, processes and precision (``--accelerator``, ``--devices``, ``--num-nodes``,
  ``--strategy``, ``--precision``: :class:`bam_pyro.distributed.DeviceSettings`, Lightning Fabric's
  names), which are not settings: a run may resume on other devices (a GPU run on a CPU), and its
  record says where it ran (``environment``). By default one process, on the GPU if there is one,
  in float32; on a machine without a GPU that is the runner as it was before Fabric, and needs no
  Lightning. The same command runs as one process, under ``torchrun`` and under SLURM's ``srun``
  (``--devices`` and ``--num-nodes`` as the launcher's processes per node and nodes; with
  ``--devices N`` and no launcher, Fabric starts the N processes). Several processes train each
  run together (data-parallel, :mod:`bam_pyro.training`): process 0 claims the run and writes its
  checkpoint, record and tables; the others write their artifacts to a scratch folder; the
  metrics a run returns are averaged over the processes (float ones; others are process 0's).
  Posterior draws after training (uncertainty metrics, attention chains) are split among the
  processes, each item or chain seeded by itself, and gathered on every process: the draws one
  process makes, at its cost divided among the processes.

      python -m experiments.glue --task rte --accelerator cuda --precision bf16-mixed
      torchrun --standalone --nproc_per_node=4 -m experiments.glue --task rte --accelerator cuda
      srun --nodes=2 --ntasks-per-node=4 python -m experiments.glue --task rte --accelerator cuda --devices 4 --num-nodes 2
"""

from bam_pyro.validation import require
from experiments.records import SettingsMismatch, setting_differences
from experiments.runner.cli import add_settings_options, build_parser, run_cli, whole_number
from experiments.runner.sweep import plan_sweep, require_agreement, run_sweep, train_one
from experiments.runner.tables import paired_table, task_tables, write_tables
from experiments.runner.task import (ATTENTION_FIELDS, OBJECTIVE_FIELDS, VARIANT_SETTINGS, RunContext, RunSettings, Task,
                                     model_device, positive)
from experiments.runner.trained import TrainedRun, load_trained

__all__ = ["ATTENTION_FIELDS", "OBJECTIVE_FIELDS", "VARIANT_SETTINGS", "RunContext", "RunSettings", "SettingsMismatch", "Task",
           "TrainedRun", "add_settings_options", "build_parser", "load_trained", "model_device", "paired_table", "plan_sweep",
           "positive", "require", "require_agreement", "run_cli", "run_sweep", "setting_differences", "task_tables", "train_one",
           "whole_number", "write_tables"]
