"""GLUE tasks from their original tsv files: reading, the task's metrics, tokenized batches.

The tsv files live under ``<data root>/glue/<TASK>/{train,dev}.tsv`` (the data root comes from
``--data-root``, ``$BAM_DATA`` or :func:`experiments.data_root.resolve_data_root`); with no data root
anywhere, the ``datasets`` library fetches the hub's copy of GLUE into the user cache. Batches are padded
per batch and drawn from buckets of similar length, which makes CPU finetuning several times
faster than padding everything to a fixed length.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pandas as pd
import torch
from scipy import stats

from experiments.data_root import require_files, resolve_data_root


@dataclass(frozen=True)
class GlueTask:
    """Where a task's columns are and how it is scored.

    ``num_labels`` is 1 for regression (STS-B). ``labels`` maps the file's label text to class
    indices when the file stores names rather than numbers. The first metric is the one GLUE
    ranks by.
    """

    folder: str
    text_columns: tuple[str, ...]
    label_column: str
    num_labels: int
    metrics: tuple[str, ...]
    header: bool = True
    column_names: Optional[tuple[str, ...]] = None
    labels: Optional[dict[str, int]] = None

    @property
    def is_regression(self) -> bool:
        return self.num_labels == 1


TASKS: dict[str, GlueTask] = {
    "rte": GlueTask("RTE", ("sentence1", "sentence2"), "label", 2, ("accuracy",),
                    labels={"entailment": 0, "not_entailment": 1}),
    "mrpc": GlueTask("MRPC", ("#1 String", "#2 String"), "Quality", 2, ("f1", "accuracy")),
    "cola": GlueTask("CoLA", ("sentence",), "label", 2, ("matthews",), header=False,
                     column_names=("source", "label", "original_label", "sentence")),
    "stsb": GlueTask("STS-B", ("sentence1", "sentence2"), "score", 1, ("pearson", "spearman")),
    "sst2": GlueTask("SST-2", ("sentence",), "label", 2, ("accuracy",)),
}


def read_split(task: str, split: str, data_root: Optional[os.PathLike] = None) -> pd.DataFrame:
    """One split as a DataFrame with columns ``text_a`` (, ``text_b``) and ``label``."""
    if task not in TASKS:
        raise ValueError(f"unknown GLUE task {task!r}; expected one of {sorted(TASKS)}")
    spec = TASKS[task]
    root, given = resolve_data_root(data_root)
    if not given:
        return hub_split(task, split, root)
    folder = root / "glue" / spec.folder
    require_files(folder, [f"{split}.tsv"], f"GLUE {task}")
    frame = pd.read_csv(
        folder / f"{split}.tsv", sep="\t", quoting=csv.QUOTE_NONE, encoding="utf-8-sig",
        header=0 if spec.header else None, names=spec.column_names, keep_default_na=False,
        dtype=str,
    )
    missing = [c for c in (*spec.text_columns, spec.label_column) if c not in frame.columns]
    if missing:
        raise ValueError(f"{folder / f'{split}.tsv'} has no column(s) {missing}; found {list(frame.columns)}")
    out = pd.DataFrame({name: frame[col] for name, col in zip(("text_a", "text_b"), spec.text_columns)})
    raw = frame[spec.label_column]
    if spec.is_regression:
        out["label"] = raw.astype(np.float32)
    elif spec.labels is not None:
        unknown = sorted(set(raw) - set(spec.labels))
        if unknown:
            raise ValueError(f"{task} {split}: unknown labels {unknown[:5]}")
        out["label"] = raw.map(spec.labels).astype(np.int64)
    else:
        out["label"] = raw.astype(np.int64)
    return out


HUB_DATASET = "nyu-mll/glue"
HUB_SPLITS = {"train": "train", "dev": "validation"}


def hub_split(task: str, split: str, cache: Path) -> pd.DataFrame:
    """One split of the hub's GLUE, fetched by ``datasets`` into ``cache``, in :func:`read_split`'s
    columns. Its label codes are those of the tsv files (RTE: 0 = entailment)."""
    from datasets import load_dataset  # imported only where a download can happen

    spec = TASKS[task]
    frame = load_dataset(HUB_DATASET, task, split=HUB_SPLITS[split], cache_dir=str(cache / "datasets")).to_pandas()
    texts = ("sentence1", "sentence2") if len(spec.text_columns) == 2 else ("sentence",)
    out = pd.DataFrame({name: frame[col] for name, col in zip(("text_a", "text_b"), texts)})
    out["label"] = frame["label"].astype(np.float32 if spec.is_regression else np.int64)
    return out


# --- metrics -------------------------------------------------------------------------------


def accuracy(pred: np.ndarray, label: np.ndarray) -> float:
    return float(np.mean(pred == label))


def f1(pred: np.ndarray, label: np.ndarray) -> float:
    """F1 of the positive class (1), as GLUE scores MRPC."""
    tp = np.sum((pred == 1) & (label == 1))
    denominator = np.sum(pred == 1) + np.sum(label == 1)
    return float(2 * tp / denominator) if denominator else 0.0


def matthews(pred: np.ndarray, label: np.ndarray) -> float:
    """Matthews correlation of binary predictions; 0 when a row or column of the confusion
    matrix is empty (a constant predictor), as scikit-learn does."""
    tp = float(np.sum((pred == 1) & (label == 1)))
    tn = float(np.sum((pred == 0) & (label == 0)))
    fp = float(np.sum((pred == 1) & (label == 0)))
    fn = float(np.sum((pred == 0) & (label == 1)))
    denominator = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return float((tp * tn - fp * fn) / denominator) if denominator else 0.0


def pearson(pred: np.ndarray, label: np.ndarray) -> float:
    return float(stats.pearsonr(pred, label)[0])


def spearman(pred: np.ndarray, label: np.ndarray) -> float:
    return float(stats.spearmanr(pred, label)[0])


METRICS = {"accuracy": accuracy, "f1": f1, "matthews": matthews, "pearson": pearson, "spearman": spearman}


def task_metrics(task: str, pred: np.ndarray, label: np.ndarray) -> dict[str, float]:
    """The task's GLUE metrics in percent: ``pred`` are class indices, or scores for STS-B."""
    return {name: 100 * METRICS[name](np.asarray(pred), np.asarray(label)) for name in TASKS[task].metrics}


# --- tokenized, length-bucketed batches ----------------------------------------------------


@dataclass
class Encoded:
    """A tokenized split: one list of token ids (and segment ids) per example, and the labels."""

    input_ids: list[list[int]]
    token_type_ids: list[list[int]]
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.input_ids)


def encode(frame: pd.DataFrame, tokenizer, max_length: int) -> Encoded:
    """Tokenize (pairs are truncated longest-first to ``max_length``), without padding."""
    pairs = frame["text_b"].tolist() if "text_b" in frame else None
    tokens = tokenizer(frame["text_a"].tolist(), pairs, truncation=True, max_length=max_length,
                       return_token_type_ids=True)
    return Encoded(tokens["input_ids"], tokens["token_type_ids"], torch.tensor(frame["label"].to_numpy()))


def collate(data: Encoded, index: np.ndarray, pad_id: int) -> tuple[tuple, dict]:
    """Pad the examples ``index`` to their longest: ``((input_ids, attention_mask, token_type_ids), {"labels"})``."""
    length = max(len(data.input_ids[i]) for i in index)
    ids = torch.full((len(index), length), pad_id, dtype=torch.long)
    types = torch.zeros((len(index), length), dtype=torch.long)
    mask = torch.zeros((len(index), length), dtype=torch.long)
    for row, i in enumerate(index):
        n = len(data.input_ids[i])
        ids[row, :n] = torch.as_tensor(data.input_ids[i])
        types[row, :n] = torch.as_tensor(data.token_type_ids[i])
        mask[row, :n] = 1
    return (ids, mask, types), {"labels": data.labels[index]}


def batches(
    data: Encoded, batch_size: int, pad_id: int, shuffle: bool, rng: Optional[np.random.Generator] = None,
    bucket: int = 50,
) -> Iterator[tuple[tuple, dict]]:
    """Batches of similar length. With ``shuffle``, examples are shuffled, sorted by length within
    chunks of ``bucket`` batches, and the batches are shuffled; without it, the whole split is
    sorted by length (evaluation: order does not matter, padding is minimal)."""
    lengths = np.array([len(ids) for ids in data.input_ids])
    if shuffle:
        rng = rng or np.random.default_rng()
        order = rng.permutation(len(data))
        chunks = [order[i:i + bucket * batch_size] for i in range(0, len(order), bucket * batch_size)]
        order = np.concatenate([c[np.argsort(lengths[c], kind="stable")] for c in chunks])
    else:
        order = np.argsort(lengths, kind="stable")
    groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if shuffle:
        groups = [groups[i] for i in rng.permutation(len(groups))]
    for group in groups:
        yield collate(data, group, pad_id)
