"""Captioned photos: the Flickr8k subset or a Karpathy-split JSON, a vocabulary, padded batches.

Two sources of the same shape (photos with several reference captions each, split by photo):

- ``<data root>/flickr8k_subset``: ``images/*.jpg`` and ``captions.txt`` (CSV ``image,caption``),
  split by photo into train / validation / test of given sizes (800 / 100 / 100 of the 1,000
  photos) by a seeded permutation of the sorted photo names;
- a Karpathy-split JSON (``dataset_coco.json``, ``dataset_flickr8k.json``, ``dataset_flickr30k.json``,
  the files captioning code reads for MS-COCO and Flickr): ``images`` with ``split`` (``train``,
  ``val``, ``test``; ``restval`` joins train, as in Karpathy's own training), ``filename``, an
  optional ``filepath`` folder under the image root, and ``sentences`` with ``raw`` text and
  ``tokens``.

Every caption is tokenized as the scorer tokenizes it (:func:`experiments.captioning.scores.ptb_tokenize`:
lowercase, punctuation removed), so training, decoding and scoring see the same words; a Karpathy
sentence without ``raw`` keeps its ``tokens``. The vocabulary holds the training captions' words
seen at least ``min_count`` times; a caption is cut to ``max_words`` words and framed as
``tgt_in = BOS w_1..w_n``, ``tgt_out = w_1..w_n EOS``. Scoring reads the raw references.
"""

from __future__ import annotations

import csv
import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from bam_pyro.validation import require, whole_number
from experiments.captioning.scores import ptb_tokenize
from experiments.data_root import require_files, resolve_data_root, utf8_lines

#: special words (ids 0..3)
PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
SUBSET = "flickr8k_subset"
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class CaptionedImage:
    """One photo: its name (unique in the corpus), file, raw reference captions and their words."""

    name: str
    path: Path
    captions: tuple[str, ...]
    words: tuple[tuple[str, ...], ...]


def captioned(name: str, path: Path, captions: Sequence[str]) -> CaptionedImage:
    return CaptionedImage(name, path, tuple(captions), tuple(tuple(ptb_tokenize(c)) for c in captions))


def read_flickr_subset(folder: Path) -> list[CaptionedImage]:
    """The photos of ``folder/captions.txt`` (CSV ``image,caption``), sorted by name."""
    require_files(folder, ["captions.txt"], "the Flickr8k subset")
    captions: dict[str, list[str]] = defaultdict(list)
    with open(folder / "captions.txt", "rb") as handle:
        reader = csv.DictReader(utf8_lines(folder / "captions.txt", handle))
        if reader.fieldnames is None or not {"image", "caption"} <= set(reader.fieldnames):
            raise ValueError(f"{folder / 'captions.txt'}: expected the CSV header 'image,caption', got {reader.fieldnames}")
        for line, row in enumerate(reader, start=2):
            if not row["image"] or not (row["caption"] or "").strip():
                raise ValueError(f"{folder / 'captions.txt'}, line {line}: empty image name or caption")
            captions[row["image"]].append(row["caption"].strip())
    return [captioned(name, folder / "images" / name, texts) for name, texts in sorted(captions.items())]


def split_by_image(images: Sequence[CaptionedImage], sizes: tuple[int, int, int], seed: int) -> dict[str, list[CaptionedImage]]:
    """Train / val / test of ``sizes`` photos each, by a seeded permutation (disjoint by photo)."""
    require(sum(sizes) <= len(images), "split sizes", sizes, f"at most {len(images)} photos in all")
    order = np.random.default_rng(seed).permutation(len(images))
    bounds = np.cumsum((0, *sizes))
    return {split: [images[i] for i in sorted(order[bounds[k]:bounds[k + 1]])] for k, split in enumerate(SPLITS)}


def read_karpathy(json_path: Path, image_root: Path) -> dict[str, list[CaptionedImage]]:
    """The splits of a Karpathy JSON (see module doc); ``image_root / filepath / filename`` is each photo."""
    try:
        document = json.loads(Path(json_path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"Karpathy split file not found: {json_path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{json_path}: not a JSON file ({error})") from None
    if not isinstance(document, dict) or not isinstance(document.get("images"), list):
        raise ValueError(f"{json_path}: expected an object with a list 'images' (Karpathy's split format)")
    splits: dict[str, list[CaptionedImage]] = {split: [] for split in SPLITS}
    for number, entry in enumerate(document["images"]):
        try:
            split = {"restval": "train"}.get(entry["split"], entry["split"])
            path = Path(image_root) / entry.get("filepath", "") / entry["filename"]
            sentences = entry["sentences"]
        except (KeyError, TypeError) as error:
            raise ValueError(f"{json_path}: image {number} lacks {error} (needs split, filename, sentences)") from None
        if split not in splits:
            raise ValueError(f"{json_path}: image {number} has split {entry['split']!r}; expected train, val, test or restval")
        if not sentences:
            raise ValueError(f"{json_path}: image {number} ({entry['filename']}) has no sentences")
        raws = [s.get("raw") or " ".join(s["tokens"]) for s in sentences]
        words = tuple(tuple(ptb_tokenize(s["raw"])) if s.get("raw") else tuple(t.lower() for t in s["tokens"])
                      for s in sentences)
        name = str(Path(entry.get("filepath", "")) / entry["filename"])
        splits[split].append(CaptionedImage(name, path, tuple(r.strip() for r in raws), words))
    return splits


class Vocabulary:
    """Words by id: the specials, then the training words seen at least ``min_count`` times (by
    descending count, then alphabetically, so the ids are reproducible)."""

    def __init__(self, captions: Sequence[Sequence[str]], min_count: int) -> None:
        whole_number("min_count", min_count)
        counts = Counter(word for caption in captions for word in caption)
        kept = sorted((w for w, n in counts.items() if n >= min_count), key=lambda w: (-counts[w], w))
        self.words = [*SPECIALS, *kept]
        self.ids = {word: i for i, word in enumerate(self.words)}

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, words: Sequence[str]) -> list[int]:
        return [self.ids.get(w, UNK) for w in words]

    def decode(self, ids: Sequence[int]) -> str:
        """A caption's text: its words up to EOS, unknown words and specials left out."""
        out = []
        for i in ids:
            if i == EOS:
                break
            if i > UNK:
                out.append(self.words[i])
        return " ".join(out)


class CaptionBatch(NamedTuple):
    """Captions with their photos' grids: ``features`` ``[B, R, C]``, ``feature_mask`` ``[B, R]``
    (all True: every cell is real), words ``tgt_in`` / ``tgt_out`` / ``tgt_mask`` ``[B, T]``."""

    features: Tensor
    feature_mask: Tensor
    tgt_in: Tensor
    tgt_mask: Tensor
    tgt_out: Tensor

    @property
    def inputs(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The network's inputs (the model's positional arguments)."""
        return self.features, self.feature_mask, self.tgt_in, self.tgt_mask

    @property
    def model_args(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of every captioning model's ``model(..., tgt_out=...)``."""
        return self.inputs, {"tgt_out": self.tgt_out}


@dataclass
class CaptionSplit:
    """One split: its photos, their grid features ``[N, R, C]``, and every caption encoded (each
    caption's photo row ``[M]``, ``tgt_in`` / ``tgt_out`` ``[M, max_words + 1]``, mask)."""

    images: list[CaptionedImage]
    features: Tensor
    image_of: Tensor
    tgt_in: Tensor
    tgt_out: Tensor
    tgt_mask: Tensor

    def __len__(self) -> int:
        return len(self.image_of)

    @property
    def references(self) -> dict[str, list[str]]:
        """Raw reference captions per photo name (what the scorer reads)."""
        return {image.name: list(image.captions) for image in self.images}

    def batch(self, rows: Tensor) -> CaptionBatch:
        """The captions ``rows`` with their photos' grids, cut to the batch's longest caption."""
        length = int(self.tgt_mask[rows].sum(-1).max())
        features = self.features[self.image_of[rows]]
        mask = torch.ones(features.shape[:2], dtype=torch.bool)
        return CaptionBatch(features, mask, self.tgt_in[rows, :length], self.tgt_mask[rows, :length],
                            self.tgt_out[rows, :length])

    def training_batches(self, batch_size: int, rng: np.random.Generator) -> Iterator[CaptionBatch]:
        """One epoch over every caption, shuffled by ``rng``."""
        order = torch.from_numpy(rng.permutation(len(self)))
        for rows in order.split(batch_size):
            yield self.batch(rows)

    def image_batches(self, batch_size: int) -> Iterator[tuple[list[CaptionedImage], Tensor, Tensor]]:
        """The photos in order, ``batch_size`` at a time: ``(photos, grids [b, R, C], mask [b, R])``."""
        for start in range(0, len(self.images), batch_size):
            features = self.features[start:start + batch_size]
            yield self.images[start:start + batch_size], features, torch.ones(features.shape[:2], dtype=torch.bool)


def encode_split(images: list[CaptionedImage], features: Tensor, vocabulary: Vocabulary, max_words: int) -> CaptionSplit:
    image_of, tgt_in, tgt_out = [], [], []
    for row, image in enumerate(images):
        for words in image.words:
            ids = vocabulary.encode(words[:max_words])
            image_of.append(row)
            tgt_in.append([BOS, *ids] + [PAD] * (max_words - len(ids)))
            tgt_out.append([*ids, EOS] + [PAD] * (max_words - len(ids)))
    tgt_in_t = torch.tensor(tgt_in, dtype=torch.long)
    mask = torch.arange(max_words + 1) <= torch.tensor([sum(t != PAD for t in row) - 1 for row in tgt_in]).unsqueeze(-1)
    return CaptionSplit(images, features, torch.tensor(image_of), tgt_in_t, torch.tensor(tgt_out, dtype=torch.long), mask)


@dataclass
class CaptionData:
    """The three splits and the vocabulary of the training captions."""

    train: CaptionSplit
    val: CaptionSplit
    test: CaptionSplit
    vocabulary: Vocabulary

    @property
    def feature_size(self) -> int:
        return self.train.features.size(-1)


def build_caption_data(splits: dict[str, list[CaptionedImage]], features_of: Callable[[list[Path]], Tensor],
                       min_count: int, max_words: int) -> CaptionData:
    """Vocabulary from the training captions, every split's grids from ``features_of(paths)``."""
    whole_number("max_words", max_words)
    for split in SPLITS:
        require(bool(splits[split]), f"the {split} split", 0, "at least one photo")
    vocabulary = Vocabulary([words for image in splits["train"] for words in image.words], min_count)
    encoded = {split: encode_split(images, features_of([image.path for image in images]), vocabulary, max_words)
               for split, images in splits.items()}
    return CaptionData(encoded["train"], encoded["val"], encoded["test"], vocabulary)


def subset_folder(data_root: Optional[str]) -> Path:
    return resolve_data_root(data_root)[0] / SUBSET
