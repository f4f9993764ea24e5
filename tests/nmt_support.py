"""Helpers of the translation tests: a tiny parallel corpus on disk."""

from __future__ import annotations

import gzip
from pathlib import Path


#: a toy corpus: German-ish sources, English-ish targets, word for word
GERMAN = ["ein", "zwei", "mann", "frau", "hund", "katze", "sitzt", "läuft", "auf", "dem", "rot", "blau"]
ENGLISH = ["a", "two", "man", "woman", "dog", "cat", "sits", "runs", "on", "the", "red", "blue"]


def toy_pairs(count: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``count`` sentence pairs of 3 to 8 words, each English word the translation of its German one."""
    import random

    rng = random.Random(seed)
    source, target = [], []
    for _ in range(count):
        words = [rng.randrange(len(GERMAN)) for _ in range(rng.randint(3, 8))]
        source.append(" ".join(GERMAN[w] for w in words).capitalize() + ".")
        target.append(" ".join(ENGLISH[w] for w in words).capitalize() + ".")
    return source, target


def write_corpus(root: Path, sizes: tuple[int, int, int] = (300, 40, 40), copy: bool = False) -> Path:
    """A data root holding ``multi30k/{train,val,test_2016_flickr}.{de,en}.gz`` of toy pairs
    (``copy``: the English sentence on both sides, a task a small model learns in seconds)."""
    folder = root / "multi30k"
    folder.mkdir(parents=True, exist_ok=True)
    for seed, (stem, count) in enumerate(zip(("train", "val", "test_2016_flickr"), sizes)):
        source, target = toy_pairs(count, seed)
        for lang, lines in zip(("de", "en"), (target if copy else source, target)):
            with gzip.open(folder / f"{stem}.{lang}.gz", "wt", encoding="utf-8") as handle:
                handle.write("\n".join(lines) + "\n")
    return root
