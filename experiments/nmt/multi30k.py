"""Multi30k German -> English: raw sentence pairs, a joint BPE vocabulary, padded batches.

The corpus is read from ``<data root>/multi30k/{train,val,test_2016_flickr}.{de,en}.gz`` (one raw
sentence a line; the data root comes from ``--data-root``, ``$BAM_DATA`` or
:func:`experiments.data_root.resolve_data_root`). With no data root anywhere, ``datasets`` fetches
the same corpus from the hub into the user cache.

A joint ``sentencepiece`` BPE is trained on the training split (both languages together, as in Deng
et al.) and cached in the user cache (:func:`experiments.data_root.default_cache`), keyed by the
training sentences and the BPE settings, so that a changed corpus or setting never reuses another
vocabulary; nothing is ever written under the data root. Pairs longer than ``max_length`` pieces
(either side) are dropped from the training split only: validation and test are scored whole.
Sources are pieces alone; targets are framed as ``tgt_in = BOS y`` and ``tgt_out = y EOS``.
"""

from __future__ import annotations

import hashlib
import io
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import sentencepiece as spm
import torch
from torch import Tensor

from bam_pyro.validation import whole_number
from experiments.data_root import default_cache, gzip_lines, require_files, resolve_data_root

#: split name -> file stem under ``<data root>/multi30k`` (the test set is the 2016 Flickr one)
SPLITS = {"train": "train", "val": "val", "test": "test_2016_flickr"}
SOURCE, TARGET = "de", "en"
#: special pieces of the BPE model (sentencepiece's own ids, fixed when it is trained)
PAD, UNK, BOS, EOS = 0, 1, 2, 3
#: the same corpus on the hub (train / validation / test = test_2016_flickr), used without a data root
HUB_DATASET = "bentrevett/multi30k"
HUB_SPLITS = {"train": "train", "val": "validation", "test": "test"}
#: pairs of training examples sorted together by length to form batches of similar lengths
POOL_BATCHES = 50


@dataclass(frozen=True)
class SentencePairs:
    """Raw sentence pairs of one split, in file order."""

    source: list[str]
    target: list[str]

    def __len__(self) -> int:
        return len(self.source)


def check_pairs(pairs: SentencePairs, where: str) -> SentencePairs:
    """Equal numbers of sentences on both sides and no empty sentence, or an error naming the line."""
    if len(pairs.source) != len(pairs.target):
        raise ValueError(
            f"{where}: {len(pairs.source)} {SOURCE} sentences but {len(pairs.target)} {TARGET} sentences"
        )
    if not pairs.source:
        raise ValueError(f"{where}: no sentences")
    for side, sentences in ((SOURCE, pairs.source), (TARGET, pairs.target)):
        for number, sentence in enumerate(sentences, start=1):
            if not sentence.strip():
                raise ValueError(f"{where} ({side}), line {number}: empty sentence")
    return pairs


def read_split(split: str, data_root: Optional[os.PathLike] = None, hub_dataset: str = HUB_DATASET) -> SentencePairs:
    """One split's raw sentence pairs: from the data root, else from the hub."""
    if split not in SPLITS:
        raise ValueError(f"unknown Multi30k split {split!r}; expected one of {sorted(SPLITS)}")
    root, given = resolve_data_root(data_root)
    if not given:
        return hub_split(split, hub_dataset, root)
    folder = root / "multi30k"
    names = [f"{SPLITS[split]}.{lang}.gz" for lang in (SOURCE, TARGET)]
    require_files(folder, names, f"Multi30k {split}")
    pairs = SentencePairs(*(gzip_lines(folder / name) for name in names))
    return check_pairs(pairs, f"{folder / names[0]} / {names[1]}")


def hub_split(split: str, hub_dataset: str, cache: Path) -> SentencePairs:
    """One split of the hub's copy of Multi30k (columns ``de`` and ``en``), fetched into ``cache``."""
    from datasets import load_dataset  # imported only where a download can happen

    table = load_dataset(hub_dataset, split=HUB_SPLITS[split], cache_dir=str(cache / "datasets"))
    pairs = SentencePairs(list(table[SOURCE]), list(table[TARGET]))
    return check_pairs(pairs, f"hub dataset {hub_dataset} ({HUB_SPLITS[split]})")


# --- BPE -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BpeSettings:
    """How the joint vocabulary is trained; every field is part of its cache key."""

    vocab_size: int = 8000
    character_coverage: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.vocab_size, int) or self.vocab_size <= EOS + 1:
            raise ValueError(f"bpe vocab_size must be an integer > {EOS + 1}, got {self.vocab_size!r}")


def bpe_cache_key(train: SentencePairs, settings: BpeSettings) -> str:
    """Digest of the training sentences, the BPE settings and the sentencepiece version."""
    digest = hashlib.sha256()
    for part in (repr(settings), spm.__version__, *train.source, *train.target):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def train_bpe(train: SentencePairs, settings: BpeSettings = BpeSettings(), cache: Optional[Path] = None) -> spm.SentencePieceProcessor:
    """The joint BPE of the training split, trained once and then read from ``<cache>/multi30k-bpe``."""
    folder = Path(cache or default_cache()) / "multi30k-bpe"
    path = folder / f"bpe-{settings.vocab_size}-{bpe_cache_key(train, settings)}.model"
    if not path.is_file():
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(train.source + train.target), model_writer=model,
                vocab_size=settings.vocab_size, model_type="bpe", character_coverage=settings.character_coverage,
                pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS, num_threads=1, minloglevel=2,
            )
        except RuntimeError as error:  # e.g. a vocabulary larger than the corpus allows
            raise ValueError(f"BPE training failed for vocab_size={settings.vocab_size}: {error}") from None
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_bytes(model.getvalue())
        os.replace(partial, path)  # atomic: a concurrent reader sees no half-written model
    return spm.SentencePieceProcessor(model_file=str(path))


# --- encoded splits and batches ----------------------------------------------------------------


@dataclass(frozen=True)
class ParallelBatch:
    """Padded id tensors of one batch. Masks are True at real tokens.

    src ``[B, S]``; tgt_in ``[B, T]`` = BOS y; tgt_out ``[B, T]`` = y EOS.
    """

    src: Tensor
    src_mask: Tensor
    tgt_in: Tensor
    tgt_out: Tensor
    tgt_mask: Tensor

    @property
    def model_args(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of ``Translator.model(src, src_mask, tgt_in, tgt_mask, tgt_out=...)``."""
        return (self.src, self.src_mask, self.tgt_in, self.tgt_mask), {"tgt_out": self.tgt_out}

    @property
    def inputs(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The network's inputs (the model's positional arguments)."""
        return self.src, self.src_mask, self.tgt_in, self.tgt_mask

    def to(self, device: torch.device) -> "ParallelBatch":
        """The batch on ``device`` (where the model is)."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})


def _padded(sequences: Sequence[np.ndarray]) -> tuple[Tensor, Tensor]:
    ids = torch.full((len(sequences), max(len(s) for s in sequences)), PAD, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.from_numpy(sequence)
    return ids, ids != PAD


def make_batch(sources: Sequence[np.ndarray], targets: Sequence[np.ndarray]) -> ParallelBatch:
    """Pad source pieces and frame target pieces (``BOS y`` in, ``y EOS`` out)."""
    src, src_mask = _padded(sources)
    bos, eos = np.array([BOS]), np.array([EOS])
    tgt_in, tgt_mask = _padded([np.concatenate([bos, t]) for t in targets])
    tgt_out, _ = _padded([np.concatenate([t, eos]) for t in targets])
    return ParallelBatch(src, src_mask, tgt_in, tgt_out, tgt_mask)


@dataclass(frozen=True)
class EncodedSplit:
    """BPE ids of a split's sentences (no special pieces) and its raw target sentences."""

    sources: list[np.ndarray]
    targets: list[np.ndarray]
    references: list[str]

    def __len__(self) -> int:
        return len(self.sources)

    def batch(self, indices: Sequence[int]) -> ParallelBatch:
        return make_batch([self.sources[i] for i in indices], [self.targets[i] for i in indices])

    def num_batches(self, batch_size: int) -> int:
        return -(-len(self) // batch_size)

    def training_batches(self, batch_size: int, rng: np.random.Generator) -> Iterator[ParallelBatch]:
        """One epoch in random order; sentences of similar length share a batch (less padding).

        Shuffled pools of ``POOL_BATCHES`` batches are sorted by length and cut into batches,
        whose order is shuffled again. Everything random comes from ``rng``, so an epoch's
        batches are a function of the generator's seed alone."""
        order = rng.permutation(len(self))
        lengths = np.array([len(s) + len(t) for s, t in zip(self.sources, self.targets)])
        pool = batch_size * POOL_BATCHES
        chunks = []
        for start in range(0, len(order), pool):
            members = order[start : start + pool]
            members = members[np.argsort(lengths[members], kind="stable")]
            chunks += [members[i : i + batch_size] for i in range(0, len(members), batch_size)]
        for index in rng.permutation(len(chunks)):
            yield self.batch(chunks[index])

    def ordered_batches(self, batch_size: int) -> Iterator[tuple[np.ndarray, ParallelBatch]]:
        """Every pair once, sorted by source length (for evaluation), with each batch's indices
        into the split so results can be put back in file order."""
        order = np.argsort([len(s) for s in self.sources], kind="stable")
        for start in range(0, len(order), batch_size):
            indices = order[start : start + batch_size]
            yield indices, self.batch(indices)


def encode_split(pairs: SentencePairs, bpe: spm.SentencePieceProcessor) -> EncodedSplit:
    as_arrays = lambda lines: [np.asarray(ids, dtype=np.int64) for ids in bpe.encode(lines)]  # noqa: E731
    return EncodedSplit(as_arrays(pairs.source), as_arrays(pairs.target), list(pairs.target))


def drop_long(split: EncodedSplit, max_length: int) -> EncodedSplit:
    """The pairs whose source and target both have at most ``max_length`` pieces."""
    keep = [i for i, (s, t) in enumerate(zip(split.sources, split.targets)) if len(s) <= max_length and len(t) <= max_length]
    return EncodedSplit([split.sources[i] for i in keep], [split.targets[i] for i in keep], [split.references[i] for i in keep])


@dataclass(frozen=True)
class Multi30k:
    """The encoded corpus and its vocabulary. ``dropped``: training pairs over the length limit."""

    bpe: spm.SentencePieceProcessor
    train: EncodedSplit
    val: EncodedSplit
    test: EncodedSplit
    dropped: int

    @property
    def vocab_size(self) -> int:
        return self.bpe.get_piece_size()

    def decode(self, ids: Sequence[int]) -> str:
        """Detokenized text of a sequence of piece ids."""
        return self.bpe.decode([int(i) for i in ids])


def load_multi30k(
    data_root: Optional[os.PathLike] = None,
    bpe: BpeSettings = BpeSettings(),
    max_length: int = 50,
    max_train: Optional[int] = None,
    hub_dataset: str = HUB_DATASET,
    cache: Optional[Path] = None,
) -> Multi30k:
    """Read, tokenize and length-filter the corpus. ``max_train`` keeps the first pairs of the
    training split only (quick runs); the BPE is always trained on the whole training split."""
    whole_number("max_length", max_length)
    splits = {name: read_split(name, data_root, hub_dataset) for name in SPLITS}
    vocabulary = train_bpe(splits["train"], bpe, cache)
    train = encode_split(splits["train"], vocabulary)
    if max_train is not None:
        train = EncodedSplit(train.sources[:max_train], train.targets[:max_train], train.references[:max_train])
    kept = drop_long(train, max_length)
    if not len(kept):
        raise ValueError(f"no training pair has at most max_length={max_length} pieces on both sides")
    return Multi30k(vocabulary, kept, encode_split(splits["val"], vocabulary), encode_split(splits["test"], vocabulary),
                    dropped=len(train) - len(kept))
