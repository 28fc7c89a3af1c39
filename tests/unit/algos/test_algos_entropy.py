"""The seed's sampled-token entropy metric against a python loop."""

from __future__ import annotations

import pytest
import torch

from rlpipe.algos.entropy import entropy_metric, sampled_token_entropy_sum


def test_sum_matches_loop_and_ignores_outside_mask():
    torch.manual_seed(0)
    lp = -torch.rand(20)
    mask = torch.rand(20) > 0.4
    lp[~mask] = float("nan")
    expected = -sum(v for v, k in zip(lp.tolist(), mask.tolist(), strict=True) if k)
    assert sampled_token_entropy_sum(lp, mask).item() == pytest.approx(expected, rel=1e-6)


def test_entropy_metric_mirrors_seed():
    torch.manual_seed(1)
    labels = [torch.tensor([-100, 3, 4, -100]), torch.tensor([-100, -100, 7, 8, 9])]
    lps = [-torch.rand(4), -torch.rand(5)]
    total = 0.0
    for lp, lab in zip(lps, labels, strict=True):
        total += -sum(v for v, x in zip(lp.tolist(), lab.tolist(), strict=True) if x != -100)
    # a global denominator larger than the local count (other ranks' tokens)
    assert entropy_metric(lps, labels, torch.tensor(10)).item() == pytest.approx(total / 10, rel=1e-6)
    assert entropy_metric(lps, labels, 0).item() == 0.0
    assert entropy_metric([], [], 5) is None
    assert entropy_metric([None, None], labels, 5) is None
    with pytest.raises(ValueError, match="None"):
        entropy_metric([lps[0], None], labels, 5)
