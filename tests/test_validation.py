"""bam_pyro.validation: the one rule for positive numbers and whole numbers that every setting uses."""

import numpy as np
import pytest

from bam_pyro.validation import positive, whole_number


def test_positive_takes_finite_numbers_of_any_real_type_above_the_minimum():
    for value in (1e-12, 3, np.float32(0.5), np.int64(2)):
        positive("lr", value)
    positive("weight_decay", 0.0, strict=False)
    positive("patience", None, optional=True)
    for value, strict in ((0.0, True), (-1.0, False), (float("nan"), True), (float("inf"), True)):
        with pytest.raises(ValueError, match=f"lr must be a finite number {'>' if strict else '>='} 0, got"):
            positive("lr", value, strict=strict)
    for value in (True, "1", None):  # True counts as 1 in Python, but no setting means it
        with pytest.raises(TypeError, match="lr must be a number"):
            positive("lr", value)


def test_whole_numbers_are_integers_not_bools_nor_whole_floats():
    whole_number("layers", 2)
    whole_number("layers", np.int64(2))
    whole_number("warm_steps", 0, minimum=0)
    whole_number("top_k", None, optional=True)
    for value in (0, 2.0, True, None):
        with pytest.raises(ValueError, match=r"^layers must be a whole number >= 1, got"):
            whole_number("layers", value)
    with pytest.raises(ValueError, match=r"^warm_steps must be a whole number >= 0, got -1"):
        whole_number("warm_steps", -1, minimum=0)
    with pytest.raises(ValueError, match=r"^top_k must be None or a whole number >= 1, got 0"):
        whole_number("top_k", 0, optional=True)
