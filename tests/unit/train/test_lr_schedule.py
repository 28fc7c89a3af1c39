"""LR schedule against the closed-form definitions."""

import math

import pytest

from rlpipe.train.optim import lr_multiplier


def test_warmup_is_linear_then_constant():
    assert [lr_multiplier(s, "constant", 4, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decays_to_min_ratio():
    values = [lr_multiplier(s, "linear", 0, 10, 0.1) for s in range(11)]
    assert values[0] == 1.0 and values[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(values, values[1:], strict=False))


def test_cosine_matches_formula():
    for s in range(0, 21):
        p = min(1.0, (s - 2) / 18) if s >= 2 else None
        expect = (s + 1) / 2 if s < 2 else 0.0 + 0.5 * (1 + math.cos(math.pi * p))
        assert lr_multiplier(s, "cosine", 2, 20) == pytest.approx(expect)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown lr_schedule"):
        lr_multiplier(5, "exp", 0, 10)
