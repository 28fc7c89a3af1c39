"""KL estimators per token against the formulas written out with python math."""

from __future__ import annotations

import math

import pytest
import torch

from rlpipe.algos.kl import KL_KINDS, kl_penalty, masked_kl_sum


def _naive(lp, ref, kind):
    d = lp - ref
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    k = min(max(ref - lp, -20.0), 20.0)
    return min(max(math.exp(k) - k - 1.0, -10.0), 10.0)


@pytest.mark.parametrize("kind", sorted(KL_KINDS))
def test_kinds_match_formula(kind):
    torch.manual_seed(1)
    lp = -torch.rand(50, dtype=torch.float64) * 5
    ref = -torch.rand(50, dtype=torch.float64) * 5
    lp[:4] = torch.tensor([-60.0, -0.1, 0.0, -3.0], dtype=torch.float64)  # extreme gaps exercise the clamps
    ref[:4] = torch.tensor([-0.1, -60.0, 0.0, -3.0], dtype=torch.float64)
    got = kl_penalty(lp, ref, kind)
    expected = torch.tensor([_naive(a, b, kind) for a, b in zip(lp.tolist(), ref.tolist(), strict=True)])
    torch.testing.assert_close(got, expected.double())
    assert torch.isfinite(got).all()


def test_aliases_and_properties():
    lp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    assert torch.equal(kl_penalty(lp, ref, "k3"), kl_penalty(lp, ref, "low_var_kl"))
    assert torch.equal(kl_penalty(lp, ref, "k2"), kl_penalty(lp, ref, "mse"))
    assert (kl_penalty(lp, ref, "k3") >= 0).all()
    assert kl_penalty(lp, ref, "k3")[2] == 0  # identical distributions
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([-5.0]), "k3").item() == pytest.approx(math.exp(-5) + 4)
    # far apart in either direction: the value is clamped at 10, never inf/NaN
    assert kl_penalty(torch.tensor([0.0, -1e4]), torch.tensor([-1e4, 0.0]), "k3").tolist() == [10.0, 10.0]


def test_gradient_of_k3():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    kl_penalty(lp, ref, "k3").sum().backward()
    k = (ref - lp.detach()).double()
    torch.testing.assert_close(lp.grad.double(), 1.0 - torch.exp(k))  # d/dlp (e^k - k - 1) = -e^k + 1


def test_unknown_kind():
    with pytest.raises(ValueError, match="known: abs, k1, k2, k3, kl, low_var_kl, mse"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "full")


def test_masked_sum():
    lp, ref = torch.tensor([-1.0, -2.0, float("nan")]), torch.tensor([-1.5, -1.0, 0.0])
    mask = torch.tensor([True, True, False])  # a garbage value outside the mask must not leak
    expected = _naive(-1.0, -1.5, "k3") + _naive(-2.0, -1.0, "k3")
    assert masked_kl_sum(lp, ref, mask, "k3").item() == pytest.approx(expected)
    assert masked_kl_sum(lp, ref, torch.zeros(3, dtype=torch.bool)).item() == 0.0
