"""easy-VQA loading: vocabulary, images, the validation split by image, and errors on bad input."""

import numpy as np
import pytest
import torch
from PIL import Image

from experiments.vqa.easy_vqa import ANSWER_TYPES, Vocabulary, load_easy_vqa, make_split, read_images


@pytest.fixture(scope="module")
def small():
    return load_easy_vqa(train_images=60, test_images=10)


def write_png(path, size=64, colour=(200, 10, 10)):
    Image.fromarray(np.full((size, size, 3), colour, dtype=np.uint8)).save(path)
    return str(path)


def test_vocabulary_encodes_right_padded_indices():
    vocabulary = Vocabulary.from_questions(["what is the red shape?", "is there a circle?"])
    encoded = vocabulary.encode(["Is there a RED circle?", "what shape?"])
    assert encoded.shape == (2, 5)
    assert [vocabulary.words[i] for i in encoded[0]] == ["is", "there", "a", "red", "circle"]
    assert [vocabulary.words[i] for i in encoded[1, :2]] == ["what", "shape"]
    assert encoded[1, 2:].tolist() == [0, 0, 0]


@pytest.mark.parametrize("question, message", [
    ("what is the purple shape?", "'purple'"),
    ("is there a <pad>?", "'<pad>'"),
    ("  ?  ", "question 0 is empty"),
    ("", "question 0 is empty"),
])
def test_bad_questions_are_named(question, message):
    vocabulary = Vocabulary.from_questions(["what is the red shape?", "is there a circle?"])
    with pytest.raises(ValueError, match=message):
        vocabulary.encode([question])


def test_images_read_as_uint8_channels_first(tmp_path):
    images = read_images([7], {7: write_png(tmp_path / "7.png")})
    assert images.dtype == torch.uint8 and images.shape == (1, 3, 64, 64)
    assert images[0, :, 0, 0].tolist() == [200, 10, 10]


def test_missing_or_malformed_images_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="image 3 has no file"):
        read_images([3], {})
    with pytest.raises(FileNotFoundError, match="image 4: .*gone.png does not exist"):
        read_images([4], {4: str(tmp_path / "gone.png")})
    with pytest.raises(ValueError, match="image 5 .* is 32x32, expected 64x64"):
        read_images([5], {5: write_png(tmp_path / "5.png", size=32)})


def test_split_refuses_unknown_answers_and_images():
    vocabulary = Vocabulary.from_questions(["is there a circle?"])
    images = torch.zeros(1, 3, 64, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="answers outside the answer list .*'maybe'"):
        make_split(["is there a circle?"], ["maybe"], [0], images, {0: 0}, vocabulary, ["yes", "no"])
    with pytest.raises(FileNotFoundError, match="image 9"):
        make_split(["is there a circle?"], ["yes"], [9], images, {0: 0}, vocabulary, ["yes", "no"])


def test_validation_split_holds_out_whole_images_reproducibly(small):
    train_images = set(small.train.image_ids.tolist())
    val_images = set(small.val.image_ids.tolist())
    assert not train_images & val_images
    assert len(val_images) == 12 and len(train_images) == 48  # a fifth of 60 images
    again = load_easy_vqa(train_images=60, test_images=10)
    assert torch.equal(again.val.image_ids, small.val.image_ids) and torch.equal(again.train.words, small.train.words)
    # each question's image row holds its image
    assert torch.equal(small.val.question_images(torch.tensor([0])), small.val.images[small.val.image_index[:1]])


def test_answer_types_follow_the_answers(small):
    split = small.test
    for answer, kind in zip(split.answers.tolist(), split.answer_types.tolist()):
        name = small.answers[answer]
        expected = "yes/no" if name in ("yes", "no") else "shape" if name in ("circle", "rectangle", "triangle") else "colour"
        assert ANSWER_TYPES[kind] == expected
    assert set(split.answer_types.tolist()) == {0, 1, 2}
