"""The posterior of the captioning attention for a few test photos: ArviZ diagnostics and the paper's Figure 1.

    python -m experiments.captioning.attention runs/captioning/runs/flickr8k-wc-seed0 \
        --figure docs/results/caption_attention.png

For a finished BAM run with a prior (loaded by :func:`experiments.runner.load_trained`), each photo
is captioned greedily (posterior-mean attention), and the model is then run teacher forced on that
caption under ``pyro.infer.Predictive`` with its guide, vectorized over draws: the attention of
every step drawn from q(S | Phi), the draws of earlier steps feeding later ones (Att2in's
recurrence), beside the contextual prior's attention (its location, normalized over the grid).
Chains are seeded ``seed + c`` (:func:`bam_pyro.diagnostics.seeded_chains`). Written:

- the figure (:func:`analysis.caption_figure.attention_figure`) of the first photo;
- ``diagnostics/`` in the run's folder (or ``--diagnostics``): :class:`bam_pyro.diagnostics.AttentionDiagnostics`
  of every step of every photo (queries ``"<photo>:<step>:<word>"``, keys the 49 cells): ESS, R-hat,
  HDI of each weight, and the ArviZ data.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from pyro.infer import Predictive

from analysis.caption_figure import attention_figure
from bam_pyro import AttentionGuide
from bam_pyro.diagnostics import AttentionDiagnostics, seeded_chains
from bam_pyro.predictive import prior_location
from experiments.captioning.task import TASK, CaptioningSettings
from experiments.captioning.captions import BOS, EOS, CaptionData, CaptionSplit, captioned, encode_split
from experiments.runner import load_trained, whole_number
from models.captioning import Captioner
from models.decoding import greedy

SITE = "attention"


def step_sites(steps: int) -> list[str]:
    """The attention site of each decoding step (:mod:`bam_pyro.sites` numbers repeated calls)."""
    return [SITE if t == 0 else f"{SITE}#{t + 1}" for t in range(steps)]


def captioned_split(model: Captioner, data: CaptionData, settings: CaptioningSettings, photos: int) -> CaptionSplit:
    """The first ``photos`` test photos, each with its greedy caption as its only caption."""
    images, features = data.test.images[:photos], data.test.features[:photos]
    ids = greedy(model, features, torch.ones(features.shape[:2], dtype=torch.bool), BOS, EOS, settings.max_words)
    captions = [data.vocabulary.decode(words) for words in ids]
    generated = [captioned(image.name, image.path, [caption]) for image, caption in zip(images, captions)]
    return encode_split(generated, features, data.vocabulary, settings.max_words)


@torch.no_grad()
def attention_draws(model: Captioner, split: CaptionSplit, draws: int) -> tuple[np.ndarray, np.ndarray]:
    """Posterior weights ``[draws, photos, steps, cells]`` and the prior's ``[photos, steps, cells]``
    (NaN after each caption's EOS), from the global RNG."""
    batch = split.batch(torch.arange(len(split)))
    was_training, was_recording = model.training, model.record_attention
    model.eval()
    model.record_attention = True
    try:
        trace = Predictive(AttentionGuide(model.model), num_samples=draws, parallel=True).get_vectorized_trace(
            *batch.inputs, tgt_out=batch.tgt_out)
    finally:
        model.train(was_training)
        model.record_attention = was_recording
    photos, steps = batch.tgt_in.shape
    posterior, prior = [], []
    for name in step_sites(steps):
        posterior.append(trace.nodes[f"{name}.weights"]["value"].reshape(draws, photos, -1))
        location = prior_location(trace.nodes[name]["infer"]["prior"]).reshape(-1, photos, posterior[-1].size(-1))[0]
        prior.append(location / location.sum(-1, keepdim=True))
    padded = ~batch.tgt_mask[..., None]
    posterior_t = torch.stack(posterior, dim=-2).double().masked_fill(padded, float("nan"))
    prior_t = torch.stack(prior, dim=-2).double().masked_fill(padded, float("nan"))
    return posterior_t.numpy(), prior_t.numpy()


def step_words(data: CaptionData, split: CaptionSplit, photo: int) -> list[str]:
    """The word each step of the photo's caption predicts (its last step: ``<eos>``)."""
    ids = split.tgt_out[photo][split.tgt_mask[photo]].tolist()
    return [data.vocabulary.words[i] for i in ids]


def main(argv: Optional[list[str]] = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(prog="python -m experiments.captioning.attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a finished BAM run's folder (<out>/runs/<run>)")
    parser.add_argument("--photos", type=whole_number(1), default=3, help="first test photos diagnosed")
    parser.add_argument("--draws", type=whole_number(4), default=100, help="draws per chain")
    parser.add_argument("--chains", type=whole_number(1), default=2)
    parser.add_argument("--shown", type=whole_number(1), default=3, help="single draws drawn in the figure")
    parser.add_argument("--figure-photo", type=whole_number(0), default=0, help="which of the photos the figure shows")
    parser.add_argument("--figure", type=Path, default=None, help="PNG path (default: <run>/figures/attention.png)")
    parser.add_argument("--diagnostics", type=Path, default=None, help="folder (default: <run>/diagnostics)")
    parser.add_argument("--data-root", default=None)
    args = parser.parse_args(argv)
    try:
        run = load_trained(TASK, args.run, args.data_root)
        if run.settings.attention.prior is None:
            raise ValueError(f"{args.run}: variant {run.settings.variant!r} has no attention prior to compare its posterior with")
        if args.figure_photo >= args.photos:
            raise ValueError(f"--figure-photo {args.figure_photo} is not among the --photos {args.photos}")
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    model, data, settings = run.model, run.data, run.settings
    split = captioned_split(model, data, settings, args.photos)
    chains = seeded_chains(lambda: attention_draws(model, split, args.draws), settings.seed, args.chains)
    posterior = np.concatenate([p for p, _ in chains])  # [draws, photos, steps, cells]
    photo = args.figure_photo
    words = step_words(data, split, photo)
    steps = len(words) - 1  # the words; the last step (EOS) is left out of the figure
    figure = attention_figure(
        data.test.images[photo].path, words[:steps], chains[0][1][photo, :steps], posterior[:, photo, :steps].mean(0),
        posterior[:args.shown, photo, :steps].transpose(1, 0, 2), args.figure or args.run / "figures" / "attention.png",
        title=f"{settings.variant} seed {settings.seed}: \"{' '.join(words[:steps])}\"")

    steps_of = [step_words(data, split, p) for p in range(len(split))]
    photo_of, step_of = np.array([(p, t) for p, words in enumerate(steps_of) for t in range(len(words))]).T

    def as_entries(draws: np.ndarray) -> np.ndarray:
        """[draws, photos, steps, cells] -> [draws, 1, caption steps, cells]: the steps up to each
        caption's end (the padding after it predicts nothing)."""
        return draws[:, photo_of, step_of][:, None]

    queries = [f"{split.images[p].name}:{t}:{steps_of[p][t]}" for p, t in zip(photo_of, step_of)]
    diagnostics = AttentionDiagnostics.of([{SITE: as_entries(p)} for p, _ in chains],
                                          [{SITE: as_entries(np.broadcast_to(q, p.shape))} for p, q in chains], queries=queries)
    written = diagnostics.write(args.diagnostics or args.run / "diagnostics", run=str(args.run))
    print(f"figure: {figure}\ndiagnostics: {written['info']} ({diagnostics.info()})")
    return {"figure": figure, **written}


if __name__ == "__main__":
    main()
