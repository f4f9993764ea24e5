"""Finetuning a pretrained transformer on GLUE, soft attention vs BAM (paper, Section 4.5).

    python -m experiments.glue --task rte mrpc --variant soft wc --seeds 0 1 2 --out runs/glue

One SVI run per (task, variant, seed), one CSV row each, scored on the GLUE dev set with the
posterior-mean prediction (eval mode: attention = its expectation). BAM keeps the pretrained
query/key weights for q and adds a randomly initialized contextual prior; the KL is not annealed
(paper, appendix B.5.2: beta=1e-2, d_mid=5, k per task). The KL's gradient stops at the
contextual prior's input (``detach_prior_keys``): with alpha = Psi * beta ~ 1e-4 the KL's
``-log Psi`` terms otherwise pull the pretrained keys harder than the task does (measured on
CoLA: 10x the soft model's gradient on the query/key weights; the model then never leaves the
majority class); ``--prior-keys-gradient`` restores it. Optimizer: AdamW, linear warmup over
the first 10% of the steps then linear decay, gradient clipping at 1. The dev set is what is
reported, so nothing is tuned or early-stopped on it: the final epoch's model is scored. To tune,
``--holdout N`` trains on the rest of the training set and scores on N training examples held
out by a fixed permutation (columns ``heldout_*`` instead of ``dev_*``).
Classification runs also report uncertainty metrics (NLL, ECE, Brier, PAvPU at p < 0.05, from
``analysis.metrics``) of ``--draws`` posterior samples of the attention (0: none; recorded with
the run's settings, since the metrics depend on it).
Rows already in ``<out>/results.csv`` are skipped; an interrupted run resumes from its checkpoint.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import pandas as pd
import torch

from analysis.metrics import sample_metrics
from analysis.tables import paired_difference, summarize
from bam_pyro import BamConfig, BayesianAttention, ObjectiveConfig, attention_sampling
from bam_pyro.config import require_positive
from bam_pyro.training import SVITrainer, seed_everything
from experiments.glue_data import TASKS, Encoded, batches, encode, read_split, task_metrics
from experiments.runs import (
    BAM_FIELDS, ResultsFile, add_contextual_prior_arguments, add_run_arguments, given_overrides, require_at_least,
    whole_number,
)
from bam_pyro import AttentionGuide
from models.transformers_bam import DEFAULT_MODEL, build_sequence_model, resolve_pretrained

#: Weibull shape k per task (paper, Table 9); tasks the paper does not list use 100.
PAPER_K = {"cola": 10.0, "stsb": 20.0, "sst2": 1000.0, "rte": 1000.0, "mrpc": 100.0}
#: ALBERT-base dev scores of the paper's Table 5, soft -> BAM-WC (STS-B: Pearson; MRPC: accuracy).
PAPER_SCORES = {"mrpc": (86.5, 88.5), "cola": (54.5, 55.8), "rte": (75.8, 76.2), "stsb": (90.3, 91.1), "sst2": (92.4, 92.7)}


@dataclass
class RunSettings:
    """Everything one finetuning run depends on."""

    task: str
    variant: str
    seed: int
    model: str  # as given (hub name, folder or the MiniLM package's name), resolved when built
    config: BamConfig
    objective: ObjectiveConfig
    lr: float = 5e-5
    weight_decay: float = 0.01
    batch_size: int = 16
    epochs: int = 3
    warmup: float = 0.1
    max_length: int = 128
    max_train: Optional[int] = None
    holdout: Optional[int] = None
    #: posterior samples for the uncertainty metrics (0: none); None for regression, which has none
    draws: Optional[int] = 10

    def __post_init__(self) -> None:
        require_positive("lr", self.lr)
        require_at_least(0, weight_decay=self.weight_decay, warmup=self.warmup, draws=self.draws)
        require_at_least(1, batch_size=self.batch_size, epochs=self.epochs, max_length=self.max_length,
                         max_train=self.max_train, holdout=self.holdout)
        if self.warmup >= 1:
            raise ValueError(f"warmup is the fraction of steps spent warming up, < 1; got {self.warmup!r}")
        if self.draws == 1:
            raise ValueError("draws must be 0 (no uncertainty metrics) or at least 2 (PAvPU's t-test), got 1")

    @property
    def scored_on(self) -> str:
        """The split the run is scored on, the prefix of its metric columns."""
        return "dev" if self.holdout is None else "heldout"

    def row(self) -> dict[str, Any]:
        c = self.config
        return dict(
            task=self.task, variant=self.variant, seed=self.seed, model=self.model,
            **{f: getattr(c, f) for f in BAM_FIELDS}, att_kl=self.objective.kl_weight,
            rho=self.objective.anneal_rate, lr=self.lr, weight_decay=self.weight_decay, warmup=self.warmup,
            batch_size=self.batch_size, epochs=self.epochs, max_length=self.max_length, max_train=self.max_train,
            holdout=self.holdout, draws=self.draws,
        )


def settings_for(task: str, variant: str, seed: int, model: str, overrides: dict[str, Any]) -> RunSettings:
    """The paper's BAM settings for ``task`` with the non-None ``overrides`` applied."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if TASKS[task].is_regression:
        given["draws"] = None  # no class probabilities, no uncertainty metrics
    bam = {"k": PAPER_K.get(task, 100.0), "beta": 1e-2, "d_mid": 5, "detach_prior_keys": True}
    bam.update({f: given.pop(f) for f in BAM_FIELDS if f in given})
    objective = ObjectiveConfig(kl_weight=given.pop("att_kl", 1.0), anneal_rate=given.pop("rho", None))
    return RunSettings(task, variant, seed, model, BamConfig(variant=variant, **bam), objective, **given)


def linear_schedule(step: int, total: int, warmup: int) -> float:
    """Learning-rate factor: linear warmup to 1 over ``warmup`` steps, then linear decay to 0."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


@torch.no_grad()
def predict(network: torch.nn.Module, data: Encoded, batch_size: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Posterior-mean outputs (eval mode) over ``data``: (outputs [n, num_labels], labels)."""
    network.eval()
    outputs, labels = [], []
    for args, targets in batches(data, 4 * batch_size, pad_id, shuffle=False):
        outputs.append(network(*args))
        labels.append(targets["labels"])
    return torch.cat(outputs).numpy(), torch.cat(labels).numpy()


def score_metrics(task: str, outputs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    pred = outputs[:, 0] if TASKS[task].is_regression else outputs.argmax(-1)
    return task_metrics(task, pred, labels)


#: uncertainty metrics of classification tasks (``analysis.metrics``), reported as ``dev_<name>``
#: (or ``heldout_<name>``)
UNCERTAINTY = ("nll", "ece", "brier", "pavpu@0.05")


def posterior_probs(
    network: torch.nn.Module, data: Encoded, batch_size: int, pad_id: int, draws: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Class probabilities ``[draws, n, classes]`` with every attention drawn from q (eval mode, so
    no dropout), and the labels in their order. transformers' modules cannot carry the extra sample
    dimension of Pyro's vectorized ``Predictive``, so each draw is one pass. A network without
    stochastic attention (soft) is a point mass: one pass, repeated."""
    stochastic = any(isinstance(m, BayesianAttention) and m.config.stochastic for m in network.modules())
    samples = []
    with attention_sampling():
        for _ in range(draws if stochastic else 1):
            outputs, labels = predict(network, data, batch_size, pad_id)
            samples.append(torch.softmax(torch.as_tensor(outputs), -1).numpy())
    return np.stack(samples if stochastic else samples * 2), labels


def uncertainty_metrics(samples: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """NLL and Brier per item; ECE and PAvPU in percent, like the GLUE metrics."""
    row = sample_metrics(samples, labels)
    percent = {"ece", "pavpu@0.05"}
    return {name: 100 * row[name] if name in percent else row[name] for name in UNCERTAINTY}


def train_glue(
    settings: RunSettings, train: Encoded, scored: Encoded, pad_id: int,
    checkpoint: Optional[Path] = None, progress: bool = True,
) -> dict[str, Any]:
    """Finetune one model; returns its result row: metrics on ``scored`` (the dev or held-out split,
    ``settings.scored_on``) of the final model's posterior-mean prediction and, for classification
    with ``settings.draws`` > 0, uncertainty metrics of that many posterior samples."""
    seed_everything(settings.seed)
    spec = TASKS[settings.task]
    bam_model = build_sequence_model(resolve_pretrained(settings.model), spec.num_labels, settings.config, settings.objective)
    optimizer = torch.optim.AdamW(bam_model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    prefix = settings.scored_on
    trainer = SVITrainer(bam_model, AttentionGuide(bam_model.model), optimizer,
                         checkpoint=checkpoint, checkpoint_every=1, grad_clip=1.0)
    steps_per_epoch = -(-len(train) // settings.batch_size)
    total = steps_per_epoch * settings.epochs
    warmup = int(settings.warmup * total)

    def epoch_batches() -> Iterator[tuple[tuple, dict]]:
        rng = np.random.default_rng([settings.seed, trainer.epoch])
        for batch in batches(train, settings.batch_size, pad_id, shuffle=True, rng=rng):
            for group in optimizer.param_groups:  # from the saved step counter: resumes exactly
                group["lr"] = settings.lr * linear_schedule(int(bam_model.step), total, warmup)
            yield batch

    def evaluate() -> dict[str, float]:
        outputs = predict(bam_model.network, scored, settings.batch_size, pad_id)
        return {f"{prefix}_{k}": v for k, v in score_metrics(settings.task, *outputs).items()}

    description = f"{settings.task}/{settings.variant}/seed{settings.seed}"
    result = trainer.fit(epoch_batches, evaluate, settings.epochs, None, progress, description, steps_per_epoch)
    final = result.history[-1]
    row = {**settings.row(), **{k: v for k, v in final.items() if k.startswith(f"{prefix}_")},
           "train_loss": final["loss"], "seconds": round(result.seconds, 1)}
    if settings.draws:
        samples, labels = posterior_probs(bam_model.network, scored, settings.batch_size, pad_id, settings.draws)
        row.update({f"{prefix}_{k}": v for k, v in uncertainty_metrics(samples, labels).items()})
    return row


def subset(frame: pd.DataFrame, size: Optional[int]) -> pd.DataFrame:
    """The first ``size`` rows of a fixed permutation (the same subset for every run)."""
    if size is None or size >= len(frame):
        return frame
    return frame.iloc[np.random.default_rng(0).permutation(len(frame))[:size]].reset_index(drop=True)


def holdout_split(frame: pd.DataFrame, size: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(rest, held out): ``size`` examples held out of a training set by a fixed permutation, the
    same for every run, so hyperparameters can be chosen without looking at the dev set."""
    if not 0 < size < len(frame):
        raise ValueError(f"--holdout must be between 1 and {len(frame) - 1} "
                         f"(the training set has {len(frame)} examples), got {size}")
    order = np.random.default_rng(1).permutation(len(frame))
    return frame.iloc[order[size:]].reset_index(drop=True), frame.iloc[order[:size]].reset_index(drop=True)


def score_prefix(runs: pd.DataFrame) -> str:
    """``dev`` or ``heldout``: the split ``runs`` were scored on (one split, or an error)."""
    held_out = runs["holdout"].notna() if "holdout" in runs else pd.Series(False, index=runs.index)
    if held_out.any() and not held_out.all():
        raise ValueError("these runs mix dev and held-out scores (--holdout); compare runs of one split")
    return "heldout" if held_out.any() else "dev"


def side_by_side(results: pd.DataFrame) -> pd.DataFrame:
    """Mean ± std over seeds of every metric (on dev, or on the held-out split), one row per
    (task, metric), one column per variant."""
    rows = []
    for task, group in results.groupby("task", sort=False):
        split = score_prefix(group)
        extra = [m for m in UNCERTAINTY if f"{split}_{m}" in group and group[f"{split}_{m}"].notna().all()]
        for metric in (*TASKS[task].metrics, *extra):
            column = f"{split}_{metric}"
            table = summarize(group, ["variant"], [column])
            paired = paired_difference(group, ["task"], column)[column]
            row = {"task": task, "metric": metric, "split": split, **table[column].to_dict(),
                   **{f"{variant} - soft (paired)": text for (_, variant), text in paired.items()},
                   "n": int(table["n"].min())}
            if split == "dev" and task in PAPER_SCORES and metric == TASKS[task].metrics[-1 if task == "mrpc" else 0]:
                row["paper (ALBERT soft -> WC)"] = "{} -> {}".format(*PAPER_SCORES[task])
            rows.append(row)
    return pd.DataFrame(rows).set_index(["task", "metric"])


OVERRIDES = (
    "k", "beta", "gamma_shape", "prior_scope", "d_mid", "detach_prior_keys", "att_kl", "rho", "lr", "weight_decay",
    "batch_size", "epochs", "warmup", "max_length", "max_train", "holdout", "draws",
)


def draw_count(text: str) -> int:
    """argparse ``type`` of --draws: 0 or at least 2, refused before training rather than after it."""
    draws = whole_number(0)(text)
    if draws == 1:
        raise argparse.ArgumentTypeError("must be 0 (no uncertainty metrics) or at least 2 (PAvPU's t-test), got 1")
    return draws


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--task", nargs="+", default=["rte"], choices=sorted(TASKS))
    add_run_arguments(p, "runs/glue", "data root holding glue/<TASK>/{train,dev}.tsv (default: $BAM_DATA or ../shared/data)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="local folder or hub name (default: the MiniLM package)")
    p.add_argument("--draws", type=draw_count, default=RunSettings.draws,
                   help="posterior samples for the uncertainty metrics of classification tasks (0: none)")
    g = p.add_argument_group("overrides (default: paper's BAM settings; lr 5e-5, batch 16, 3 epochs, length 128)")
    for name in ("k", "beta", "att_kl", "rho", "lr", "weight_decay", "warmup"):
        g.add_argument(f"--{name.replace('_', '-')}", type=float, default=None)
    for name in ("d_mid", "batch_size", "epochs", "max_length", "max_train"):
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    g.add_argument("--holdout", type=int, default=None, metavar="N",
                   help="score on N training examples held out of training (for tuning) instead of the dev set")
    add_contextual_prior_arguments(g)
    g.add_argument("--prior-keys-gradient", dest="detach_prior_keys", action="store_const", const=False, default=None,
                   help="let the KL's gradient reach the keys through the contextual prior (by default it stops there)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> pd.DataFrame:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained(args.model))
    out = Path(args.out)
    results = ResultsFile(out, ("task", "variant", "seed"))
    overrides = given_overrides(args, OVERRIDES)
    for task in args.task:
        settings = [settings_for(task, v, s, args.model, overrides) for s in args.seeds for v in args.variant]  # paired by seed
        max_length, max_train, holdout = settings[0].max_length, settings[0].max_train, settings[0].holdout
        train = read_split(task, "train", args.data_root)
        train, scored = (train, read_split(task, "dev", args.data_root)) if holdout is None else holdout_split(train, holdout)
        train, scored = (encode(frame, tokenizer, max_length) for frame in (subset(train, max_train), scored))
        for run in settings:
            if results.has(run.row()):
                continue
            start = time.perf_counter()
            row = train_glue(run, train, scored, tokenizer.pad_token_id, results.checkpoint(run.row()), not args.no_progress)
            prefix = f"{run.scored_on}_"
            scores = ", ".join(f"{k[len(prefix):]} {v:.3g}" for k, v in row.items() if k.startswith(prefix))
            print(f"{task:5s} {run.variant:5s} seed {run.seed}: {scores} ({time.perf_counter() - start:.0f}s)", flush=True)
            results.add(row)
    done = results.frame
    table = side_by_side(done[done.task.isin(args.task) & done.variant.isin(args.variant)])
    (out / "table.md").write_text(table.to_markdown() + "\n")
    print(table.to_markdown())
    return table


if __name__ == "__main__":
    main()
