"""easy-VQA (pip ``easy-vqa``): 64x64 images of one coloured shape, template questions, 13 answers.

Questions become word indices over a vocabulary built from the training questions (index 0 is
padding), images a uint8 tensor ``[images, 3, 64, 64]`` read once with PIL (about 2 s for all 5,000,
so nothing is cached), and every question keeps the row of its image. A validation split holds out
a fraction of the *training images* (with all their questions) by a fixed seed, so that no
validation image is seen in training.

Words outside the vocabulary are an error, not an unknown token: the questions come from a closed
set of templates (26 words; the test questions use no other), so an unseen word means a typo or
data from elsewhere, and an untrained unknown-word embedding would answer it without warning.

Answer types (the paper's Table 7 reports VQA's per answer type): ``yes/no``, ``shape`` and
``colour``, read off the answer, which determines it (every question template has answers of one
type only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np
import torch
from PIL import Image
from torch import Tensor

ANSWER_TYPES = ("yes/no", "shape", "colour")
SHAPES = ("circle", "rectangle", "triangle")
PADDING = "<pad>"
IMAGE_SIZE = 64


def tokenize(question: str) -> list[str]:
    """Lower-case words of a question; spaces and ``?.,!`` separate them."""
    return re.findall(r"[^\s?.,!]+", question.lower())


def type_key(answer_type: str) -> str:
    """Column-friendly name of an answer type (``yes/no`` -> ``yesno``)."""
    return answer_type.replace("/", "")


def answer_type(answer: str) -> str:
    if answer in ("yes", "no"):
        return "yes/no"
    return "shape" if answer in SHAPES else "colour"


@dataclass(frozen=True)
class Vocabulary:
    """Question words by index; index 0 is padding."""

    words: tuple[str, ...]

    @classmethod
    def from_questions(cls, questions: Sequence[str]) -> "Vocabulary":
        return cls((PADDING, *sorted({w for q in questions for w in tokenize(q)})))

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, questions: Sequence[str]) -> Tensor:
        """Word indices ``[questions, longest]``, right-padded with 0. An empty question or a word
        outside the vocabulary is an error naming the question."""
        index = {w: i for i, w in enumerate(self.words)}
        rows = []
        for n, question in enumerate(questions):
            words = tokenize(question)
            if not words:
                raise ValueError(f"question {n} is empty ({question!r})")
            unknown = [w for w in words if w not in index or w == PADDING]
            if unknown:
                raise ValueError(f"question {n} ({question!r}) has words outside the vocabulary of the "
                                 f"training questions ({len(self) - 1} words): {', '.join(map(repr, unknown))}")
            rows.append([index[w] for w in words])
        encoded = torch.zeros(len(rows), max(map(len, rows), default=0), dtype=torch.long)
        for n, row in enumerate(rows):
            encoded[n, : len(row)] = torch.tensor(row)
        return encoded


def read_images(ids: Sequence[int], paths: Mapping[int, str]) -> Tensor:
    """The images ``ids`` as uint8 ``[len(ids), 3, 64, 64]`` (RGB). A missing or malformed image is
    an error naming it."""
    images = torch.empty(len(ids), 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.uint8)
    for row, image_id in enumerate(ids):
        if image_id not in paths:
            raise FileNotFoundError(f"image {image_id} has no file (the questions refer to it)")
        path = Path(paths[image_id])
        if not path.is_file():
            raise FileNotFoundError(f"image {image_id}: {path} does not exist")
        with Image.open(path) as image:
            pixels = np.array(image.convert("RGB"))
        if pixels.shape != (IMAGE_SIZE, IMAGE_SIZE, 3):
            raise ValueError(f"image {image_id} ({path}) is {pixels.shape[1]}x{pixels.shape[0]}, expected {IMAGE_SIZE}x{IMAGE_SIZE}")
        images[row] = torch.from_numpy(pixels).permute(2, 0, 1)
    return images


@dataclass
class VqaSplit:
    """Questions of one split over its images.

    ``words`` ``[n, length]`` (0 = padding); ``image_index`` ``[n]``: row of each question's image
    in ``images`` ``[images, 3, 64, 64]`` uint8; ``answers`` ``[n]`` and ``answer_types`` ``[n]``
    index :data:`ANSWER_TYPES`; ``questions`` and ``image_ids`` (the data set's ids) for display.
    """

    words: Tensor
    image_index: Tensor
    images: Tensor
    answers: Tensor
    answer_types: Tensor
    questions: list[str]
    image_ids: Tensor

    def __len__(self) -> int:
        return len(self.answers)

    def question_words(self, rows: Tensor) -> Tensor:
        """The words of questions ``rows``, ``[len(rows), longest of them]`` (less padding to compute)."""
        words = self.words[rows]
        return words[:, : int((words != 0).sum(1).max())]

    def question_images(self, rows: Tensor) -> Tensor:
        """The images of questions ``rows``, ``[len(rows), 3, 64, 64]`` uint8."""
        return self.images[self.image_index[rows]]


@dataclass
class EasyVqa:
    train: VqaSplit
    val: VqaSplit
    test: VqaSplit
    vocabulary: Vocabulary
    answers: tuple[str, ...]

    @property
    def majority_answer(self) -> int:
        """The most frequent training answer (the accuracy of always giving it is the floor)."""
        return int(torch.bincount(self.train.answers, minlength=len(self.answers)).argmax())


def make_split(
    questions: Sequence[str], answers: Sequence[str], image_ids: Sequence[int], images: Tensor,
    image_rows: Mapping[int, int], vocabulary: Vocabulary, answer_list: Sequence[str],
) -> VqaSplit:
    """A split from raw questions; ``image_rows`` maps an image id to its row of ``images``."""
    if not len(questions) == len(answers) == len(image_ids):
        raise ValueError(f"got {len(questions)} questions, {len(answers)} answers and {len(image_ids)} image ids")
    answer_index = {a: i for i, a in enumerate(answer_list)}
    unknown = sorted(set(answers) - set(answer_index))
    if unknown:
        raise ValueError(f"answers outside the answer list {list(answer_list)}: {unknown}")
    missing = sorted(set(image_ids) - set(image_rows))
    if missing:
        raise FileNotFoundError(f"{len(missing)} questions' images have no file, e.g. image {missing[0]}")
    return VqaSplit(
        words=vocabulary.encode(questions),
        image_index=torch.tensor([image_rows[i] for i in image_ids], dtype=torch.long),
        images=images,
        answers=torch.tensor([answer_index[a] for a in answers], dtype=torch.long),
        answer_types=torch.tensor([ANSWER_TYPES.index(answer_type(a)) for a in answers], dtype=torch.long),
        questions=list(questions),
        image_ids=torch.tensor(list(image_ids), dtype=torch.long),
    )


def select_images(image_ids: Sequence[int], limit: Optional[int], seed: int) -> list[int]:
    """The distinct images of ``image_ids`` in a fixed random order, the first ``limit`` of them."""
    distinct = np.array(sorted(set(image_ids)))
    order = np.random.default_rng(seed).permutation(len(distinct))
    return distinct[order][:limit].tolist()


def subset(questions, answers, image_ids, keep: set[int]) -> tuple[list, list, list]:
    rows = [n for n, i in enumerate(image_ids) if i in keep]
    return [questions[n] for n in rows], [answers[n] for n in rows], [image_ids[n] for n in rows]


def load_easy_vqa(
    validation_fraction: float = 0.2, split_seed: int = 0,
    train_images: Optional[int] = None, test_images: Optional[int] = None,
) -> EasyVqa:
    """easy-VQA's training images split into train and validation (``validation_fraction`` of the
    images, chosen with ``split_seed``), and its test set. ``train_images`` / ``test_images`` keep
    a fixed random subset of that many images (for quick runs and tests)."""
    import easy_vqa

    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must lie in (0, 1), got {validation_fraction}")
    answer_list = tuple(easy_vqa.get_answers())
    train_raw = easy_vqa.get_train_questions()
    test_raw = easy_vqa.get_test_questions()
    vocabulary = Vocabulary.from_questions(train_raw[0])

    train_ids = select_images(train_raw[2], train_images, split_seed)
    n_val = max(1, round(validation_fraction * len(train_ids)))
    if n_val >= len(train_ids):
        raise ValueError(f"{len(train_ids)} training images leave none for training after the validation split")
    train_pixels = read_images(train_ids, easy_vqa.get_train_image_paths())
    rows = {image_id: row for row, image_id in enumerate(train_ids)}
    val_ids = set(train_ids[:n_val])
    test_ids = select_images(test_raw[2], test_images, split_seed)
    test_pixels = read_images(test_ids, easy_vqa.get_test_image_paths())

    def split(raw, keep, pixels, image_rows) -> VqaSplit:
        return make_split(*subset(*raw, keep), pixels, image_rows, vocabulary, answer_list)

    return EasyVqa(
        train=split(train_raw, set(train_ids) - val_ids, train_pixels, rows),
        val=split(train_raw, val_ids, train_pixels, rows),
        test=split(test_raw, set(test_ids), test_pixels, {i: r for r, i in enumerate(test_ids)}),
        vocabulary=vocabulary,
        answers=answer_list,
    )
