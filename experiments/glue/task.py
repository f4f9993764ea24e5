"""Finetuning a pretrained transformer on GLUE, soft attention vs BAM (paper, Section 4.5).

    python -m experiments.glue --task rte mrpc --variant soft wc --seeds 0 1 2 --out runs/glue

One SVI run per (task, variant, seed), scored on the GLUE dev set with the posterior-mean prediction
(eval mode: attention = its expectation). BAM keeps the pretrained query/key weights for q and adds a
randomly initialized contextual prior; the KL is not annealed (paper, appendix B.5.2: beta=1e-2,
d_mid=5, k per task). The KL's gradient stops at the contextual prior's input
(``detach_prior_keys``): with alpha = Psi * beta ~ 1e-4 the KL's ``-log Psi`` terms otherwise pull
the pretrained keys harder than the task does (measured on CoLA: 10x the soft model's gradient on the
query/key weights; the model then never leaves the majority class); ``--no-detach-prior-keys``
restores it. Optimizer: AdamW, transformers' linear schedule (warmup over the first 10% of the steps,
then linear decay), gradient clipping at 1. The dev set is what is reported, so nothing is tuned or
early-stopped on it: the final epoch's model is scored. To tune, ``--holdout N`` trains on the rest
of the training set and scores on N training examples held out by a fixed permutation. Classification
runs also report uncertainty metrics (NLL, ECE, Brier, PAvPU) of ``--draws`` posterior samples of
the attention.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np
import pandas as pd
import torch
from transformers import get_linear_schedule_with_warmup

from bam_pyro.metrics import uncertainty_report
from analysis.tables import paired_difference, summarize
from bam_pyro import AttentionGuide, BamModel
from bam_pyro.distributed import Engine
from bam_pyro.predictive import has_stochastic_attention, predictive_draws
from bam_pyro.training import seed_everything
from experiments.glue.data import TASKS, Encoded, GlueData, batches, load_glue, task_metrics
from experiments.runner import RunContext, RunSettings, Task, model_device, positive, require, run_cli
from experiments.runner.draws import shared_draws
from bam_pyro.transformers import DEFAULT_MODEL, build_sequence_model, resolve_pretrained

#: Weibull shape k per task (paper, Table 9); tasks the paper does not list use 100.
PAPER_K = {"cola": 10.0, "stsb": 20.0, "sst2": 1000.0, "rte": 1000.0, "mrpc": 100.0}
#: ALBERT-base dev scores of the paper's Table 5, soft -> BAM-WC (STS-B: Pearson; MRPC: accuracy).
PAPER_SCORES = {"mrpc": (86.5, 88.5), "cola": (54.5, 55.8), "rte": (75.8, 76.2), "stsb": (90.3, 91.1), "sst2": (92.4, 92.7)}
#: uncertainty metrics of classification tasks reported beside the task's own
UNCERTAINTY = ("nll", "ece", "brier", "pavpu@0.05")


@dataclass(frozen=True)
class GlueSettings(RunSettings):
    task: str = "rte"
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "local folder or hub name (default: the MiniLM package)"})
    lr: float = 5e-5
    weight_decay: float = 0.01
    batch_size: int = 16
    epochs: int = 3
    warmup: float = field(default=0.1, metadata={"help": "fraction of the steps spent warming up"})
    max_length: int = 128
    max_train: Optional[int] = field(default=None, metadata={"help": "train on a fixed random subset of N examples"})
    holdout: Optional[int] = field(default=None, metadata={
        "help": "score on N training examples held out of training (for tuning) instead of the dev set"})
    draws: int = field(default=10, metadata={
        "help": "posterior samples for the uncertainty metrics (0: none; regression tasks have none)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.task in TASKS, "task", self.task, f"one of {sorted(TASKS)}")
        positive("lr", self.lr)
        positive("weight_decay", self.weight_decay, strict=False)
        for name in ("batch_size", "epochs", "max_length", "max_train", "holdout"):
            positive(name, getattr(self, name), minimum=1, strict=False)
        require(0 <= self.warmup < 1, "warmup", self.warmup, "a fraction of the steps in [0, 1)")
        require(self.draws == 0 or self.draws >= 2, "draws", self.draws, "0 (no uncertainty metrics) or at least 2 (PAvPU's t-test)")
        if TASKS[self.task].is_regression:
            object.__setattr__(self, "draws", 0)  # no class probabilities, no uncertainty metrics

    @property
    def scored_on(self) -> str:
        return "dev" if self.holdout is None else "heldout"


def presets(task: str, variant: str) -> dict[str, Any]:
    return {"k": PAPER_K.get(task, 100.0), "beta": 1e-2, "d_mid": 5, "detach_prior_keys": True}


@torch.no_grad()
def predict(network: torch.nn.Module, data: Encoded, batch_size: int, collator) -> tuple[np.ndarray, np.ndarray]:
    """Posterior-mean outputs (eval mode) over ``data``: (outputs [n, num_labels], labels), in
    :func:`~experiments.glue.data.evaluation_order`."""
    network.eval()
    device = model_device(network)
    outputs, labels = [], []
    for args, targets in batches(data, 4 * batch_size, collator, shuffle=False):
        outputs.append(network(*(arg.to(device) for arg in args)))
        labels.append(targets["labels"])
    return torch.cat(outputs).cpu().numpy(), torch.cat(labels).cpu().numpy()


def posterior_probs(bam_model: BamModel, data: Encoded, batch_size: int, collator, draws: int, *, seed: int,
                    dropout: bool = False, engine: Optional[Engine] = None) -> tuple[np.ndarray, np.ndarray]:
    """Class probabilities ``[draws, n, classes]`` of posterior draws
    (:func:`bam_pyro.predictive.predictive_draws`: eval mode, every attention drawn from q, no
    dropout), and the labels, both in :func:`~experiments.glue.data.evaluation_order`; the draws of
    a batch run as one pass, folded into the batch (:mod:`bam_pyro.transformers.folding`). A network
    without stochastic attention (soft) is a point mass: two draws, the fewest the metrics take.
    ``dropout``: MC dropout besides, the network's own dropout on in every draw (then each draw is a
    pass of its own, and a soft network gets ``draws`` draws too). Batch ``b`` is drawn seeded by
    ``(seed, b)``, by its share's process of ``engine``'s (:func:`~experiments.runner.draws.shared_draws`):
    the same draws on any number of processes."""
    stochastic = dropout or has_stochastic_attention(bam_model)
    device = model_device(bam_model)
    scored = list(batches(data, 4 * batch_size, collator, shuffle=False))

    def draw(index: int) -> torch.Tensor:
        args = tuple(arg.to(device) for arg in scored[index][0])
        return predictive_draws(bam_model, args, draws if stochastic else 2, dropout=dropout).probs.cpu()

    samples = shared_draws(draw, len(scored), seed, engine)
    return torch.cat(samples, dim=1).numpy(), torch.cat([targets["labels"] for _, targets in scored]).numpy()


def scores(task: str, outputs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    pred = outputs[:, 0] if TASKS[task].is_regression else outputs.argmax(-1)
    return task_metrics(task, pred, labels)


def build_model(settings: GlueSettings, data: Optional[GlueData] = None) -> BamModel:
    """The model finetuning starts from: the pretrained encoder with BAM attention and a new head."""
    return build_sequence_model(resolve_pretrained(settings.model), TASKS[settings.task].num_labels,
                                settings.attention, settings.objective)


def train(settings: GlueSettings, data: GlueData, run: RunContext) -> dict[str, float]:
    """Finetune one model; the metrics of its final epoch's posterior-mean prediction on the scored
    split and, with draws, uncertainty metrics of that many posterior samples."""
    seed_everything(settings.seed)
    bam_model = build_model(settings, data)
    optimizer = torch.optim.AdamW(bam_model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    steps_per_epoch = -(-len(data.train) // settings.batch_size)
    total = run.steps_per_process(steps_per_epoch) * settings.epochs
    schedule = get_linear_schedule_with_warmup(optimizer, int(settings.warmup * total), total)
    trainer = run.trainer(bam_model, AttentionGuide(bam_model.model), optimizer, grad_clip=1.0,
                          checkpoint_every=1, scheduler=schedule)

    def epoch_batches() -> Iterator[tuple[tuple, dict]]:
        rng = np.random.default_rng([settings.seed, trainer.epoch])
        return batches(data.train, settings.batch_size, data.collator, shuffle=True, rng=rng)

    def evaluate() -> dict[str, float]:
        return scores(settings.task, *predict(bam_model.network, data.scored, settings.batch_size, data.collator))

    result = trainer.fit(epoch_batches, evaluate, settings.epochs, None, run.progress, run.description, steps_per_epoch)
    final = result.history[-1]
    metrics = {name: final[name] for name in TASKS[settings.task].metrics}
    metrics["train_loss"] = final["loss"]
    if settings.draws:
        samples, labels = posterior_probs(bam_model, data.scored, settings.batch_size, data.collator, settings.draws,
                                          seed=settings.seed, engine=run.engine)
        report = uncertainty_report(samples, labels)
        metrics.update({name: report[name] for name in UNCERTAINTY})
    return metrics


def load(settings: GlueSettings, data_root: Optional[str]) -> GlueData:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return load_glue(settings.task, resolve_pretrained(settings.model), settings.max_length,
                     settings.max_train, settings.holdout, data_root)


def metrics_of(task: str) -> tuple[str, ...]:
    return TASKS[task].metrics if TASKS[task].is_regression else (*TASKS[task].metrics, *UNCERTAINTY)


def side_by_side(results: pd.DataFrame) -> pd.DataFrame:
    """Mean ± std over seeds of every metric, one row per (task, metric), one column per variant,
    the paired differences to soft, and the paper's figures (dev set only)."""
    rows = []
    for task, group in results.groupby("task", sort=False):
        split = "heldout" if group["holdout"].notna().any() else "dev"
        for metric in (m for m in metrics_of(task) if m in group and group[m].notna().all()):
            table = summarize(group, ["variant"], [metric])
            paired = paired_difference(group, ["task"], metric)[metric]
            row = {"task": task, "metric": metric, "split": split, **table[metric].to_dict(),
                   **{f"{variant} - soft (paired)": text for (_, variant), text in paired.items()},
                   "n": int(table["n"].min())}
            if split == "dev" and task in PAPER_SCORES and metric == TASKS[task].metrics[-1 if task == "mrpc" else 0]:
                row["paper (ALBERT soft -> WC)"] = "{} -> {}".format(*PAPER_SCORES[task])
            rows.append(row)
    table = pd.DataFrame(rows).set_index(["task", "metric"])
    paper = "paper (ALBERT soft -> WC)"
    return table.assign(**{paper: table[paper].fillna("")}) if paper in table else table


TASK = Task(
    name="glue", settings=GlueSettings, panel="task", panels=tuple(TASKS), load=load, train=train,
    metrics=metrics_of, presets=presets, tables=lambda results: {"glue": side_by_side(results)}, build=build_model,
    description=__doc__.split("\n\n")[0],
)


def main(argv: Optional[list[str]] = None) -> dict[str, pd.DataFrame]:
    return run_cli(TASK, argv)

