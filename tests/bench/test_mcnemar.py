"""bench/_common.mcnemar_exact against values worked by hand from the binomial distribution (not from the code)."""

from __future__ import annotations

import pytest


@pytest.fixture
def mcnemar(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from _common import mcnemar_exact

    return mcnemar_exact


def test_ten_gains_no_losses(mcnemar):
    # 10 discordant pairs, all gains: P(X >= 10 | n=10, 1/2) = 1/1024.
    res = mcnemar([0.0] * 10 + [1.0] * 5, [1.0] * 10 + [1.0] * 5)
    assert (res["gained"], res["lost"]) == (10, 0)
    assert res["p_improved"] == pytest.approx(1 / 1024)
    assert res["p_two_sided"] == pytest.approx(2 / 1024)


def test_six_gains_two_losses(mcnemar):
    # n = 8: P(X >= 6) = (28 + 8 + 1) / 256 = 37/256; the two-sided exact p is twice that, 0.2890625.
    before = [0, 0, 0, 0, 0, 0, 1, 1, 1, 0]
    after = [1, 1, 1, 1, 1, 1, 0, 0, 1, 0]
    res = mcnemar(before, after)
    assert (res["gained"], res["lost"]) == (6, 2)
    assert res["p_improved"] == pytest.approx(37 / 256)
    assert res["p_two_sided"] == pytest.approx(74 / 256)


def test_losses_give_a_large_one_sided_p(mcnemar):
    # 1 gain, 4 losses: P(X >= 1 | n=5) = 31/32; the two-sided p is 2 * P(X <= 1) = 2 * 6/32.
    res = mcnemar([1, 1, 1, 1, 0], [0, 0, 0, 0, 1])
    assert res["p_improved"] == pytest.approx(31 / 32)
    assert res["p_two_sided"] == pytest.approx(12 / 32)


def test_no_discordant_pairs_is_no_evidence(mcnemar):
    res = mcnemar([1, 0, 1], [1, 0, 1])
    assert res["p_improved"] == 1.0 and res["p_two_sided"] == 1.0


def test_unpaired_lengths_are_an_error(mcnemar):
    with pytest.raises(ValueError, match="equal lengths"):
        mcnemar([1, 0], [1])
