"""Image captioning with Att2in: soft attention, BAM and hard attention (paper, Section 4.3 and appendix B.3).

    python -m experiments.captioning --variant soft wc --seeds 0 1 2 --out runs/captioning
    python -m experiments.captioning --variant lc hard --seeds 0 --out runs/captioning
    python -m experiments.captioning --dataset karpathy --karpathy-json dataset_coco.json --image-root COCO_DIR

One SVI run per (variant, seed) of Att2in (:mod:`models.captioning`) over the 7 x 7 grid of a
pretrained EfficientNet-Lite0 (:mod:`experiments.captioning.features`, cached). Data
(:mod:`experiments.captioning.captions`): the Flickr8k subset under the data root (1,000 photos x 5
captions, split by photo 800 / 100 / 100 with ``split_seed``), or any Karpathy-split JSON with its
image folder (MS-COCO, Flickr8k, Flickr30k). Training is MLE (teacher forcing, each caption of a
photo its own example) with Adam; each epoch ends with greedy captions of the validation photos,
scored by CIDEr, on which training stops early (``patience``), keeping the best epoch. The kept model
captions the validation and test photos greedily (beam search with ``--beam-size``), scored in one
call per split (:func:`experiments.captioning.scores.score_captions`: BLEU-1..4, CIDEr, ROUGE-L,
METEOR where ``java`` runs, in percent); the captions are kept in the run's folder
(``captions/{val,test}.json``).

Variants: ``soft``; the BAM variants with the paper's captioning presets (LC: sigma_1=1e3,
sigma_2=0.1; WC: k=10, beta=1e-6; both d_mid=10, rho=1; WF and LF take the same q and a fixed
prior); ``hard``: Deng et al.'s hard attention from :mod:`bam_pyro.alignment` (one location drawn
per step from the attention, REINFORCE with the soft-attention likelihood as baseline), whose
prediction sums the location out exactly. In eval mode BAM's attention is its posterior mean, i.e.
soft attention with the learned weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import pandas as pd
import torch

from bam_pyro import AttentionGuide, BamModel
from bam_pyro.alignment import AlignmentConfig, LatentAlignmentModel, elbo_for, guide_for
from bam_pyro.training import EarlyStopping, seed_everything
from bam_pyro.validation import whole_number
from experiments.captioning.features import GridFeatureExtractor
from experiments.captioning.scores import score_captions
from experiments.captioning.tables import tables
from experiments.captioning.captions import (BOS, EOS, CaptionData, CaptionSplit, build_caption_data, read_flickr_subset,
                                  read_karpathy, split_by_image, subset_folder)
from experiments.runner import RunContext, RunSettings, Task, model_device, positive, require, run_cli
from experiments.runner.fitting import Trainable, fit_epochs
from models.captioning import Att2inSizes, CaptionNetwork, build_captioner
from models.decoding import beam_search, greedy

#: the attention settings of each variant; LC and WC are the paper's (appendix B.3), WF and LF share
#: their q and rho with a fixed, centred prior (WF: Gamma(1e-6, 1e-6), mean 1; LF: LogNormal(0, 1e3), median 1)
VARIANT_PRESETS: dict[str, dict[str, Any]] = {
    "soft": {},
    "lc": {"sigma_p": 1e3, "sigma_q": 0.1, "d_mid": 10, "anneal_rate": 1.0},
    "wc": {"k": 10.0, "beta": 1e-6, "d_mid": 10, "anneal_rate": 1.0},
    "lf": {"sigma_p": 1e3, "sigma_q": 0.1, "anneal_rate": 1.0},
    "wf": {"k": 10.0, "beta": 1e-6, "alpha": 1e-6, "anneal_rate": 1.0},
    "hard": {},
}

#: the scores in the order of the tables (the first is paired against soft)
SCORE_NAMES = ("bleu4", "cider", "bleu1", "bleu2", "bleu3", "meteor", "rouge_l")


@dataclass(frozen=True)
class CaptioningSettings(RunSettings):
    """One captioning run (every field is a command-line option and a column of its record)."""

    dataset: Literal["flickr8k", "karpathy"] = "flickr8k"
    karpathy_json: Optional[str] = field(default=None, metadata={"help": "dataset: karpathy: the split file (dataset_coco.json ...)"})
    image_root: Optional[str] = field(default=None, metadata={"help": "dataset: karpathy: the folder its filepath/filename are under"})
    train_images: int = field(default=800, metadata={"help": "flickr8k: photos of the training split"})
    val_images: int = field(default=100, metadata={"help": "flickr8k: photos of the validation split"})
    test_images: int = field(default=100, metadata={"help": "flickr8k: photos of the test split"})
    split_seed: int = field(default=0, metadata={"help": "flickr8k: seed of the split by photo"})
    min_count: int = field(default=3, metadata={"help": "vocabulary: training words seen at least this often"})
    max_words: int = field(default=16, metadata={"help": "captions are cut to this many words"})
    embedding: int = 256
    hidden: int = field(default=256, metadata={"help": "LSTM width (and the embedded grid cells')"})
    attention_size: int = field(default=256, metadata={"help": "inner width of the additive attention"})
    dropout: float = 0.5
    lr: float = field(default=5e-4, metadata={"help": "Adam's learning rate"})
    batch_size: int = field(default=50, metadata={"help": "captions per step"})
    grad_clip: float = field(default=5.0, metadata={"help": "largest gradient norm"})
    max_epochs: int = field(default=10, metadata={"help": "epochs at most (early stopping on validation CIDEr keeps the best)"})
    patience: int = field(default=3, metadata={"help": "epochs without a better validation CIDEr before stopping"})
    beam_size: int = field(default=1, metadata={"help": "1: greedy decoding (the paper's); more: beam search"})
    eval_batch_size: int = 100

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.variant in VARIANT_PRESETS, "variant", self.variant, f"one of {sorted(VARIANT_PRESETS)}")
        for name in ("train_images", "val_images", "test_images", "min_count", "max_words", "batch_size",
                     "max_epochs", "patience", "beam_size", "eval_batch_size"):
            whole_number(name, getattr(self, name))
        whole_number("split_seed", self.split_seed, minimum=0)
        positive("lr", self.lr)
        positive("grad_clip", self.grad_clip)
        karpathy = self.dataset == "karpathy"
        require(karpathy == (self.karpathy_json is not None), "karpathy_json", self.karpathy_json,
                "given with --dataset karpathy (and only then)")
        require(karpathy == (self.image_root is not None), "image_root", self.image_root,
                "given with --dataset karpathy (and only then)")
        self.sizes  # noqa: B018  (validates the widths and the dropout)

    @property
    def sizes(self) -> Att2inSizes:
        return Att2inSizes(self.embedding, self.hidden, self.attention_size, self.dropout)


def presets(dataset: str, variant: str) -> dict[str, Any]:
    return dict(VARIANT_PRESETS.get(variant, {}))


def load_data(settings: CaptioningSettings, data_root: Optional[str],
              extractor: Optional[GridFeatureExtractor] = None) -> CaptionData:
    """The splits, the vocabulary and every photo's grid (cached; computed the first time)."""
    if settings.dataset == "karpathy":
        splits = read_karpathy(Path(settings.karpathy_json), Path(settings.image_root))
    else:
        images = read_flickr_subset(subset_folder(data_root))
        splits = split_by_image(images, (settings.train_images, settings.val_images, settings.test_images),
                                settings.split_seed)
    return build_caption_data(splits, extractor or GridFeatureExtractor(), settings.min_count, settings.max_words)


def build_trainable(settings: CaptioningSettings, data: CaptionData) -> Trainable:
    """The variant's Pyro model, guide and ELBO (None: the library's, analytic KL at attention sites)."""
    vocab_size = len(data.vocabulary)
    if settings.variant == "hard":
        network = CaptionNetwork(vocab_size, data.feature_size, settings.sizes, settings.attention)
        model = LatentAlignmentModel(network, settings.objective, AlignmentConfig("hard"))
        return Trainable(model, guide_for(model), elbo_for("hard"))
    model = build_captioner(vocab_size, data.feature_size, settings.sizes, settings.attention, settings.objective)
    return Trainable(model, AttentionGuide(model.model))


def build_model(settings: CaptioningSettings, data: CaptionData) -> BamModel:
    """The untrained model of a run (what ``experiments.runner.load_trained`` fills)."""
    return build_trainable(settings, data).model


# --- captions and scores -------------------------------------------------------------------------


def caption_split(model: BamModel, data: CaptionData, split: CaptionSplit, settings: CaptioningSettings) -> dict[str, str]:
    """Each photo's caption (greedy, or beam search), by photo name."""
    captions, device = {}, model_device(model)
    for images, features, mask in split.image_batches(settings.eval_batch_size):
        features, mask = features.to(device), mask.to(device)
        if settings.beam_size == 1:
            ids = greedy(model, features, mask, BOS, EOS, settings.max_words)
        else:
            ids = beam_search(model, features, mask, BOS, EOS, settings.beam_size, max_length=settings.max_words)
        captions.update((image.name, data.vocabulary.decode(words)) for image, words in zip(images, ids))
    return captions


def split_scores(model: BamModel, data: CaptionData, split: CaptionSplit, settings: CaptioningSettings,
                 meteor: Optional[bool]) -> tuple[dict[str, float], dict[str, str]]:
    """Scores of the split's captions (one scorer call: CIDEr's document frequencies are the split's)."""
    captions = caption_split(model, data, split, settings)
    return score_captions(split.references, captions, meteor=meteor), captions


def train_run(settings: CaptioningSettings, data: CaptionData, run: RunContext) -> dict[str, float]:
    seed_everything(settings.seed)
    trainable = build_trainable(settings, data)
    model = trainable.model
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr, fused=True)  # fused: one kernel for all
    trainer = run.trainer(model, trainable.guide, optimizer, elbo=trainable.elbo,
                          grad_clip=settings.grad_clip, checkpoint_every=1)

    def evaluate() -> dict[str, float]:
        scores, _ = split_scores(model, data, data.val, settings, meteor=False)
        return {"val_cider": scores["cider"], "val_bleu4": scores["bleu4"]}

    metrics = fit_epochs(trainer, run, data.train, settings.batch_size, -(-len(data.train) // settings.batch_size),
                         evaluate, settings.max_epochs, EarlyStopping({"val_cider": "max"}, settings.patience))
    for name, split in (("val", data.val), ("test", data.test)):
        scores, captions = split_scores(model, data, split, settings, meteor=None)
        metrics.update({f"{name}_{score}": value for score, value in scores.items()})
        (run.folder / "captions").mkdir(parents=True, exist_ok=True)
        (run.folder / "captions" / f"{name}.json").write_text(json.dumps(captions, indent=1, sort_keys=True) + "\n")
    return metrics


TASK = Task(
    name="captioning", settings=CaptioningSettings, panel="dataset", panels=("flickr8k", "karpathy"), load=load_data,
    train=train_run, metrics=tuple(f"test_{s}" for s in SCORE_NAMES) + ("seconds_per_step", "parameters"),
    presets=presets, variants=tuple(VARIANT_PRESETS), tables=tables, build=build_model, description=__doc__.split("\n\n")[0],
)


def main(argv: Optional[list[str]] = None) -> dict[str, pd.DataFrame]:
    return run_cli(TASK, argv)

