"""Scoring a trained VQA model: clean and noisy image features, posterior draws, the noise sweep, and
the attention report (ArviZ diagnostics and a picture of a few test questions).

Grid features are computed once per test image (the CNN is deterministic, see :mod:`models.vqa`);
the noisy data add ``sqrt(variance) * noise`` to them, with one standard normal ``noise`` per image
drawn from ``noise_seed``: every run, variant and variance sees the same noise, scaled.

Sampling modes of the posterior draws (``pyro.infer.Predictive`` over the model and its guide,
vectorized over draws, through :func:`bam_pyro.predictive.predictive_draws`):

- ``full``: the network in training mode, so MC dropout, and for BAM also q(S | Phi) at every
  attention site; the paper's uncertainty of soft attention (dropout only) and of BAM (both);
- ``attention``: eval mode, q(S | Phi) alone (BAM only; soft attention has no other randomness).

Draws cost about twice a posterior-mean pass each (MC dropout's random masks as much as the rest),
so they score a fixed random subset of the test questions (``uncertainty_questions``, the same for
every run); accuracy of the posterior mean is always over the whole test set.

A run's metrics of condition c (``clean``, ``noisy``) and mode m are ``c.m.<metric>`` (those of
:func:`bam_pyro.metrics.uncertainty_report`), and per answer type ``c.m.<type>.<metric>``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from bam_pyro.diagnostics import AttentionDiagnostics, Chain, attention_chains
from bam_pyro.metrics import PAVPU_THRESHOLDS, top_two_pvalues, uncertainty_report
from analysis.vqa_figures import QuestionView, attention_picture
from bam_pyro import BamConfig
from bam_pyro.distributed import Engine
from bam_pyro.predictive import predictive_draws
from bam_pyro.training import seed_everything
from experiments.vqa.easy_vqa import ANSWER_TYPES, EasyVqa, VqaSplit, tokenize, type_key
from experiments.runner import model_device
from experiments.runner.draws import shared_draws
from models.vqa import VqaModel, guided_attention_sites

#: the PAvPU threshold of the headline columns (the paper does not say which it used)
PAVPU_HEADLINE = 0.05
#: metrics reported per answer type (all of :func:`uncertainty_report` overall)
PER_TYPE = ("accuracy", *(f"pavpu@{t:g}" for t in PAVPU_THRESHOLDS))
ACCURACY = {"clean": "test_acc", "noisy": "noisy_acc"}


def modes_for(config: BamConfig) -> list[str]:
    return ["full", "attention"] if config.stochastic else ["full"]


@torch.no_grad()
def grid_features(model: VqaModel, split: VqaSplit, batch: int) -> torch.Tensor:
    """The CNN's grid features of every image of ``split``, ``[images, cells, features]``, on the model's device."""
    model.eval()
    device = model_device(model)
    return torch.cat([model.network.image_features(images.to(device)) for images in split.images.split(batch)])


def feature_noise(shape: torch.Size, seed: int) -> torch.Tensor:
    """Standard normal noise of ``shape`` from its own CPU generator (the global RNG is left alone,
    and the noise is the same whatever device the features are on)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def noisy(clean: torch.Tensor, noise: torch.Tensor, variance: float) -> torch.Tensor:
    """The noisy data's grid features: ``clean + sqrt(variance) * noise``, on the features' device."""
    return clean + math.sqrt(variance) * noise.to(clean.device)


@torch.no_grad()
def posterior_mean_logits(model: VqaModel, split: VqaSplit, batch: int, features: Optional[torch.Tensor] = None,
                          rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Logits ``[questions, answers]`` of the posterior-mean prediction (eval mode: every attention
    replaced by its mean, no dropout) of the questions ``rows`` (default: all), from the images or
    from per-image grid ``features``; on the CPU."""
    model.eval()
    device = model_device(model)
    logits = []
    for rows in (torch.arange(len(split)) if rows is None else rows).split(batch):
        words = split.question_words(rows).to(device)
        if features is None:
            logits.append(model.network(words, split.question_images(rows).to(device)).cpu())
        else:
            logits.append(model.network(words, features=features[split.image_index[rows]]).cpu())
    return torch.cat(logits)


def uncertainty_rows(split: VqaSplit, count: int, seed: int) -> torch.Tensor:
    """The questions of ``split`` the posterior draws score (test) or a temperature is fitted on
    (validation): a fixed random ``count`` of them (the same for every run of a seed), or all when
    ``count`` is 0."""
    if count == 0 or count >= len(split):
        return torch.arange(len(split))
    chosen = np.random.default_rng(seed).choice(len(split), size=count, replace=False)
    return torch.from_numpy(np.sort(chosen))


def posterior_probs(model: VqaModel, split: VqaSplit, features: torch.Tensor, mode: str, rows: torch.Tensor,
                    settings, engine: Optional[Engine] = None) -> torch.Tensor:
    """Answer probabilities ``[samples, len(rows), answers]`` of ``settings.samples`` posterior
    draws in ``mode`` of the questions ``rows``, on the CPU. Batch ``b`` of ``settings.eval_batch``
    questions is drawn seeded by (the run's seed, ``b``), by its share's process of ``engine``'s
    (:func:`~experiments.runner.draws.shared_draws`): the same draws on any number of processes."""
    device = model_device(model)
    parts = rows.split(settings.eval_batch)

    def draw(index: int) -> torch.Tensor:
        part = parts[index]
        inputs = (split.question_words(part).to(device), None, features[split.image_index[part]])
        return predictive_draws(model, inputs, settings.samples, dropout=mode == "full", chunk_size=settings.chunk).probs.cpu()

    probs = torch.cat(shared_draws(draw, len(parts), settings.seed, engine), dim=1).double()
    return probs / probs.sum(-1, keepdim=True)


def accuracy_by_type(predictions: torch.Tensor, split: VqaSplit, name: str) -> dict[str, float]:
    """Accuracy in percent overall (``name``) and per answer type (``name.<type>``)."""
    correct = (predictions == split.answers).double()
    metrics = {name: 100 * correct.mean().item()}
    for index, answer_type in enumerate(ANSWER_TYPES):
        chosen = split.answer_types == index
        if chosen.any():
            metrics[f"{name}.{type_key(answer_type)}"] = 100 * correct[chosen].mean().item()
    return metrics


def uncertainty_by_type(probs: torch.Tensor, split: VqaSplit, rows: torch.Tensor, prefix: str) -> dict[str, float]:
    """:func:`uncertainty_report` of the draws of questions ``rows``, overall and (:data:`PER_TYPE`)
    per answer type."""
    answers, types = split.answers[rows], split.answer_types[rows]
    metrics = uncertainty_report(probs, answers, prefix=prefix)
    for index, answer_type in enumerate(ANSWER_TYPES):
        chosen = types == index
        if chosen.any():
            report = uncertainty_report(probs[:, chosen], answers[chosen])
            metrics.update({f"{prefix}{type_key(answer_type)}.{m}": report[m] for m in PER_TYPE})
    return metrics


def condition_metrics(model: VqaModel, split: VqaSplit, features: torch.Tensor, condition: str, settings,
                      rows: torch.Tensor, engine: Optional[Engine] = None) -> dict[str, float]:
    """Accuracy (posterior mean) on every test question and, with ``settings.samples``, every
    sampling mode's uncertainty metrics on the questions ``rows``, given their grid features."""
    predictions = posterior_mean_logits(model, split, settings.eval_batch, features).argmax(-1)
    metrics = accuracy_by_type(predictions, split, ACCURACY[condition])
    if settings.samples:
        for mode in modes_for(settings.attention):
            probs = posterior_probs(model, split, features, mode, rows, settings, engine)
            metrics.update(uncertainty_by_type(probs, split, rows, f"{condition}.{mode}."))
    return metrics


def noise_sweep(model: VqaModel, split: VqaSplit, clean: torch.Tensor, noise: torch.Tensor, settings,
                rows: torch.Tensor, scored: dict[str, float], engine: Optional[Engine] = None) -> dict[str, float]:
    """``sweep.<variance>.acc`` (posterior mean, every test question) and, with samples,
    ``sweep.<variance>.pavpu@<t>`` (``full`` mode, the questions ``rows``) for every variance of
    ``settings.sweep_variances``; the clean and noisy data's figures are taken from ``scored``."""
    metrics = {}
    for variance in settings.sweep_variances:
        known = {0.0: "clean", settings.noise_variance: "noisy"}.get(variance)
        name = f"sweep.{variance:g}."
        if known is not None:
            metrics[name + "acc"] = scored[ACCURACY[known]]
            metrics.update({name + f"pavpu@{t:g}": scored[f"{known}.full.pavpu@{t:g}"]
                            for t in PAVPU_THRESHOLDS if f"{known}.full.pavpu@{t:g}" in scored})
            continue
        features = noisy(clean, noise, variance)
        predictions = posterior_mean_logits(model, split, settings.eval_batch, features).argmax(-1)
        metrics[name + "acc"] = accuracy_by_type(predictions, split, "acc")["acc"]
        if settings.samples:
            report = uncertainty_report(posterior_probs(model, split, features, "full", rows, settings, engine), split.answers[rows])
            metrics.update({name + f"pavpu@{t:g}": report[f"pavpu@{t:g}"] for t in PAVPU_THRESHOLDS})
    return metrics


# --- the attention report --------------------------------------------------------------------


def diagnosed_questions(split: VqaSplit, count: int) -> torch.Tensor:
    """``count`` test questions on as many different images: first one of each answer type, then
    the next ones in order."""
    chosen, images, types = [], set(), set()
    for wanted_new_type in (True, False):
        for row in range(len(split)):
            image, kind = int(split.image_index[row]), int(split.answer_types[row])
            if len(chosen) < count and image not in images and (kind not in types or not wanted_new_type):
                chosen.append(row)
                images.add(image)
                types.add(kind)
    return torch.tensor(sorted(chosen))


def attention_report(model: VqaModel, data: EasyVqa, settings, folder: Path, engine: Optional[Engine] = None) -> None:
    """ArviZ diagnostics (ESS, R-hat, HDI) of the guided attention's posterior q on a few test
    questions (``settings.chains`` chains of ``settings.diag_draws`` draws, eval mode: attention
    noise alone) into ``folder/diagnostics``, and their picture, ``folder/figures/attention.png``.

    The quantity diagnosed is the attention each question word gets from the image grid: the
    guided attention averaged over the grid cells (queries), per layer, head and word. Its prior
    (the prior's location Psi normalized over the words) is stored beside it.
    """
    split = data.test
    rows = diagnosed_questions(split, settings.diag_questions)
    model.eval()
    device = model_device(model)
    with torch.no_grad():
        inputs = (split.question_words(rows).to(device), None,
                  model.network.image_features(split.question_images(rows).to(device)))
    posterior, prior = guided_attention_chains(model, inputs, settings, engine)
    write_diagnostics(posterior, prior, rows, [split.questions[r] for r in rows.tolist()], folder / "diagnostics")
    draw_questions(model, data, rows, inputs, posterior, prior, settings, folder / "figures" / "attention.png")


def guided_attention_chains(model: VqaModel, inputs: tuple, settings,
                            engine: Optional[Engine] = None) -> tuple[list[Chain], list[Chain]]:
    """Per chain (:func:`bam_pyro.diagnostics.attention_chains`, each process of ``engine`` drawing
    its share of the chains), layer -> guided attention ``[draws, heads, questions, words]``
    averaged over the grid cells (NaN at padding), for the posterior and for the prior."""
    valid = inputs[0] != 0  # [Q, L]

    def grid_average(weights: torch.Tensor) -> torch.Tensor:  # [draws, Q, H, G, L] -> [draws, H, Q, L]
        return weights.double().mean(-2).transpose(1, 2).masked_fill(~valid, math.nan)

    return attention_chains(model, inputs, settings.diag_draws, seed=settings.seed, chains=settings.chains,
                            layers=guided_attention_sites(model), select_attention=grid_average, chunk_size=settings.chunk,
                            engine=engine)


def write_diagnostics(posterior: list[Chain], prior: list[Chain], rows: torch.Tensor, questions: list[str],
                      out: Path) -> None:
    """:meth:`~bam_pyro.diagnostics.AttentionDiagnostics.write` into ``out``, the summary with the
    word of each entry, the info with the questions' texts."""
    diagnostics = AttentionDiagnostics.of(posterior, prior, queries=rows.tolist())
    words = {row: tokenize(question) for row, question in zip(rows.tolist(), questions)}
    index = zip(diagnostics.summary.index.get_level_values("query"), diagnostics.summary.index.get_level_values("key"))
    diagnostics.summary.insert(0, "word", [words[question][position] for question, position in index])
    diagnostics.write(out, texts=questions)


def draw_questions(model: VqaModel, data: EasyVqa, rows: torch.Tensor, inputs: tuple, posterior: list[Chain],
                   prior: list[Chain], settings, path: Path) -> Path:
    """The picture of the diagnosed questions (see :func:`analysis.vqa_figures.attention_picture`):
    the last guided-attention layer's draws (heads averaged), its prior, the image reduction's
    weights of the posterior-mean pass, and ``settings.diag_draws`` answer draws in ``full`` mode
    (the uncertainty PAvPU scores)."""
    split, last = data.test, guided_attention_sites(model)[-1]
    attention = np.concatenate([chain[last] for chain in posterior]).mean(1)  # [draws, Q, L]
    prior_weights = np.concatenate([chain[last] for chain in prior]).mean((0, 1))  # [Q, L]
    seed_everything(settings.seed)
    with torch.no_grad():
        answers = predictive_draws(model, inputs, settings.diag_draws, dropout=True, chunk_size=settings.chunk).probs.double().cpu()
        model.eval()
        image_weights = model.network.outputs(*inputs).image_weights.reshape(len(rows), settings.grid, settings.grid)
    answers = answers / answers.sum(-1, keepdim=True)
    pvalues = top_two_pvalues(answers)
    views = []
    for q, row in enumerate(rows.tolist()):
        length = int((inputs[0][q] != 0).sum())
        views.append(QuestionView(
            image=split.question_images(rows[q : q + 1])[0].permute(1, 2, 0).cpu().numpy(), question=split.questions[row],
            words=tokenize(split.questions[row]), attention_draws=attention[:, q, :length], prior=prior_weights[q, :length],
            answer_draws=answers[:, q].cpu().numpy(), answers=data.answers, truth=int(split.answers[row]),
            pvalue=float(pvalues[q]), image_weights=image_weights[q].cpu().numpy(),
        ))
    title = (f"{settings.variant}, seed {settings.seed}: the last guided-attention layer (q's draws, eval mode); "
             "answers drawn with MC dropout and attention noise")
    return attention_picture(views, path, title=title)
