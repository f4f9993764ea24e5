"""Visual question answering on easy-VQA with a small MCAN, soft attention vs BAM (paper, Section 4.2
and appendix B.2), one SVI run per (variant, seed).

    python -m experiments.vqa --variant soft wc --seeds 0 1 2 --out runs/vqa
    python -m experiments.vqa --variant lf lc wf --seeds 0 --out runs/vqa      # the other variants, same folder
    python -m experiments.collect runs/vqa --out runs/vqa                        # the tables and figures again

Every self- and guided-attention layer is Bayesian (``models.vqa``); presets hold the paper's VQA
hyperparameters, each overridable. A run trains with early stopping on the validation images (a
fixed fifth of the training images) and scores the kept model on the test set:

- accuracy of the posterior-mean prediction (eval mode, attention = its mean), overall and per
  answer type (yes/no, shape, colour; the paper's Table 7), on clean and on noisy image features
  (Gaussian noise of variance ``--noise-variance``, 5 as in the paper, added to the CNN's
  standardized grid features at test time only);
- uncertainty of ``--samples`` posterior draws (PAvPU at p < 0.01, 0.05, 0.1, ECE, NLL, ...) of
  ``--uncertainty-questions`` test questions (a fixed random subset; 0: all), in two sampling modes
  (see :mod:`experiments.vqa.uncertainty`): ``full`` (MC dropout, and for BAM the attention noise
  too: the paper's uncertainty for both) and ``attention`` (BAM's attention noise alone);
- accuracy and PAvPU against the noise variance (``--noise-sweep``);
- for BAM with a prior, on seed ``--diagnostics-seed``: ArviZ diagnostics of the guided attention's
  posterior on a few test questions and a picture of them (image, attention, answer uncertainty).

The tables follow the paper's Table 2 (accuracy and PAvPU, original and noisy, paired differences to
soft) and Table 7 (per answer type); ``figures/noise-sweep.png`` draws the sweep.
easy-VQA's data ship inside its pip package, so ``--data-root`` is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Optional

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from bam_pyro import AttentionGuide
from bam_pyro.training import EarlyStopping, seed_everything
from experiments.vqa.easy_vqa import EasyVqa, VqaSplit, load_easy_vqa
from experiments.runner import RunContext, RunSettings, Task, positive, require, run_cli
from experiments.vqa.uncertainty import (
    PAVPU_HEADLINE, attention_report, condition_metrics, feature_noise, grid_features, noise_sweep, noisy,
    posterior_mean_logits, uncertainty_rows,
)
from experiments.vqa.tables import tables
from analysis.vqa_figures import noise_sweep_figure
from models.vqa import McanSizes, VqaModel, build_vqa_model

#: BAM's VQA hyperparameters (appendix B.2.3); sigma_p / sigma_q are the paper's sigma_1 / sigma_2,
#: anneal_rate its rho. The paper does not give the KL weight.
PRESETS: dict[str, dict[str, Any]] = {
    "lf": dict(sigma_p=1e9, sigma_q=1e-9, anneal_rate=0.2),
    "lc": dict(sigma_p=1e9, sigma_q=1e-9, anneal_rate=0.2, d_mid=20),
    "wf": dict(k=1000.0, beta=1e-2, alpha=1e-3, anneal_rate=0.2),
    "wc": dict(k=1000.0, beta=1e-6, anneal_rate=0.1, d_mid=20),
}


@dataclass(frozen=True)
class VqaSettings(RunSettings):
    dataset: Literal["easy-vqa"] = "easy-vqa"
    hidden: int = field(default=128, metadata={"help": "width of the attention layers"})
    heads: int = 4
    encoder_layers: int = field(default=2, metadata={"help": "self-attention layers over the question"})
    decoder_layers: int = field(default=2, metadata={"help": "self- + guided-attention layers over the image"})
    features: int = field(default=64, metadata={"help": "channels of the CNN's grid features"})
    grid: int = field(default=4, metadata={"help": "the image is a grid x grid of feature cells (4, 8 or 16)"})
    dropout: float = 0.1
    lr: float = field(default=3e-4, metadata={"help": "Adam's learning rate (1e-3 stalled on validation)"})
    batch_size: int = 128
    max_epochs: int = 10
    patience: int = field(default=3, metadata={"help": "epochs without improvement of validation accuracy or loss"})
    validation_fraction: float = field(default=0.2, metadata={"help": "fraction of the training images held out"})
    split_seed: int = field(default=0, metadata={"help": "seed of the validation split and of image subsets"})
    train_images: Optional[int] = field(default=None, metadata={"help": "use a fixed subset of N training images"})
    test_images: Optional[int] = field(default=None, metadata={"help": "use a fixed subset of N test images"})
    noise_variance: float = field(default=5.0, metadata={"help": "variance of the noisy data's feature noise"})
    noise_sweep: str = field(default="1,2,10", metadata={
        "help": "more noise variances, comma-separated, for the accuracy/PAvPU-vs-noise curve ('' for none)"})
    noise_seed: int = field(default=0, metadata={"help": "seed of the feature noise (the same for every run)"})
    samples: int = field(default=20, metadata={"help": "posterior draws M for the uncertainty metrics (0: none)"})
    uncertainty_questions: int = field(default=2000, metadata={
        "help": "test questions (a fixed random subset) the posterior draws score (0: all)"})
    chunk: int = field(default=10, metadata={"help": "draws per vectorized pass"})
    eval_batch: int = field(default=256, metadata={"help": "questions per scoring pass"})
    chains: int = field(default=2, metadata={"help": "chains of the attention diagnostics (0: none)"})
    diag_questions: int = field(default=4, metadata={"help": "test questions diagnosed and drawn"})
    diag_draws: int = field(default=200, metadata={"help": "draws per chain of the attention diagnostics"})
    diagnostics_seed: int = field(default=0, metadata={"help": "the seed whose BAM runs write diagnostics"})

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("hidden", "heads", "encoder_layers", "decoder_layers", "batch_size", "max_epochs",
                     "patience", "train_images", "test_images", "chunk", "eval_batch", "diag_questions"):
            positive(name, getattr(self, name), minimum=1, strict=False)
        positive("diag_draws", self.diag_draws, minimum=4, strict=False)  # ArviZ's ESS needs 4 per chain
        positive("lr", self.lr)
        require(0 <= self.dropout < 1, "dropout", self.dropout, "in [0, 1)")
        require(0 < self.validation_fraction < 1, "validation_fraction", self.validation_fraction, "in (0, 1)")
        positive("noise_variance", self.noise_variance)
        self.sweep_variances  # noqa: B018  (validates the list)
        require(self.samples == 0 or self.samples >= 2, "samples", self.samples, "0 or at least 2 (PAvPU's t-test)")
        positive("chains", self.chains, strict=False)
        positive("uncertainty_questions", self.uncertainty_questions, strict=False)
        self.sizes  # noqa: B018  (validates the layer sizes)

    @property
    def sizes(self) -> McanSizes:
        return McanSizes(hidden=self.hidden, heads=self.heads, encoder_layers=self.encoder_layers,
                         decoder_layers=self.decoder_layers, features=self.features, grid=self.grid, dropout=self.dropout)

    @property
    def sweep_variances(self) -> list[float]:
        """Every noise variance scored: 0 (clean), the noisy data's and the sweep's, ascending."""
        return sweep_variances(self.noise_variance, self.noise_sweep)


def sweep_variances(noise_variance: float, noise_sweep: str) -> list[float]:
    """The noise variances a run of these settings scores: 0 (clean), ``noise_variance`` and those
    listed in ``noise_sweep`` (comma-separated), ascending; also read off a run's record by the
    shift tables (:mod:`experiments.vqa.shift_tables`)."""
    try:
        listed = [float(v) for v in noise_sweep.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"noise_sweep must be comma-separated numbers, got {noise_sweep!r}") from None
    bad = [v for v in listed if not (math.isfinite(v) and v >= 0)]
    require(not bad, "noise_sweep", noise_sweep, "a list of finite variances >= 0")
    return sorted({0.0, noise_variance, *listed})


def presets(dataset: str, variant: str) -> dict[str, Any]:
    return dict(PRESETS.get(variant, {}))


def build_model(settings: VqaSettings, data: EasyVqa) -> VqaModel:
    """The untrained model these settings describe."""
    return build_vqa_model(len(data.vocabulary), len(data.answers), settings.attention, settings.objective, settings.sizes)


def training_batches(split: VqaSplit, batch_size: int, rng: np.random.Generator) -> Iterator[tuple[tuple, dict]]:
    """One epoch of shuffled batches ``((words, images), {"answers": ...})``: clean images only."""
    order = torch.from_numpy(rng.permutation(len(split)))
    for rows in order.split(batch_size):
        yield (split.question_words(rows), split.question_images(rows)), {"answers": split.answers[rows]}


def validation_metrics(model: VqaModel, split: VqaSplit, batch: int) -> dict[str, float]:
    logits = posterior_mean_logits(model, split, batch)
    return {"val_loss": F.cross_entropy(logits, split.answers).item(),
            "val_acc": 100 * (logits.argmax(-1) == split.answers).double().mean().item()}


def train_model(settings: VqaSettings, data: EasyVqa, run: RunContext) -> VqaModel:
    """SVI with early stopping on validation accuracy and loss; the model of the kept epoch."""
    seed_everything(settings.seed)
    model = build_model(settings, data)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr, betas=(0.9, 0.98))
    trainer = run.trainer(model, AttentionGuide(model.model), optimizer, checkpoint_every=1)

    def batches() -> Iterator[tuple[tuple, dict]]:
        return training_batches(data.train, settings.batch_size, np.random.default_rng([settings.seed, trainer.epoch]))

    stopping = EarlyStopping({"val_acc": "max", "val_loss": "min"}, patience=settings.patience)
    steps = -(-len(data.train) // settings.batch_size)
    trainer.fit(batches, lambda: validation_metrics(model, data.val, settings.eval_batch), settings.max_epochs,
                stopping, run.progress, run.description, steps)
    return model


def train(settings: VqaSettings, data: EasyVqa, run: RunContext) -> dict[str, float]:
    """Train one model and score it (see the module docstring for the metrics)."""
    model = train_model(settings, data, run)
    metrics = validation_metrics(model, data.val, settings.eval_batch)
    clean = grid_features(model, data.test, settings.eval_batch)
    noise = feature_noise(clean.shape, settings.noise_seed)
    rows = uncertainty_rows(data.test, settings.uncertainty_questions, settings.split_seed)
    conditions = {"clean": clean, "noisy": noisy(clean, noise, settings.noise_variance)}
    for condition, features in conditions.items():
        metrics.update(condition_metrics(model, data.test, features, condition, settings, rows, run.engine))
    metrics.update(noise_sweep(model, data.test, clean, noise, settings, rows, metrics, run.engine))
    if settings.chains and settings.seed == settings.diagnostics_seed and settings.attention.prior is not None:
        attention_report(model, data, settings, run.folder, run.engine)
    return metrics


def load(settings: VqaSettings, data_root: Optional[str]) -> EasyVqa:
    return load_easy_vqa(settings.validation_fraction, settings.split_seed, settings.train_images, settings.test_images)


TASK = Task(
    name="vqa", settings=VqaSettings, panel="dataset", panels=("easy-vqa",), load=load, train=train,
    metrics=("test_acc", "noisy_acc", f"clean.full.pavpu@{PAVPU_HEADLINE:g}", f"noisy.full.pavpu@{PAVPU_HEADLINE:g}"),
    presets=presets, variants=("soft", "lf", "lc", "wf", "wc"), tables=tables,
    after_sweep=lambda results, out: noise_sweep_figure(results, out / "figures" / "noise-sweep.png"),
    build=build_model, description=__doc__.split("\n\n")[0], data_source="the easy-vqa package",
)


def main(argv: Optional[list[str]] = None) -> dict[str, pd.DataFrame]:
    return run_cli(TASK, argv)

