"""PPO-clip and GSPO losses, their metrics and the loss aggregations, against naive per-token python loops."""

from __future__ import annotations

import math

import pytest
import torch

from rlpipe.algos.policy_loss import AGG_MODES, POLICY_LOSSES, aggregate, gspo, policy_loss, ppo_clip


def _naive_ppo(lp, old, adv, mask, lo, hi, c, w=None):
    """Per-token loss and clip counts written out with python floats."""
    losses, counts = [], {"low": 0, "high": 0, "dual": 0}
    for t in range(len(lp)):
        if not mask[t]:
            losses.append(0.0)
            continue
        r = math.exp(min(max(lp[t] - old[t], -20.0), 20.0))
        a = adv[t]
        pg1, pg2 = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
        loss = max(pg1, pg2)
        if pg2 > pg1 and r < 1 - lo:
            counts["low"] += 1
        if pg2 > pg1 and r > 1 + hi:
            counts["high"] += 1
        if a < 0:
            if loss > -a * c:
                counts["dual"] += 1
            loss = min(loss, -a * c)
        losses.append(loss * (w[t] if w is not None else 1.0))
    return losses, counts


def _inputs(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    old = lp + torch.randn(n, generator=g, dtype=torch.float64) * 0.6  # ratios from ~0.2 to ~5
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > 0.2
    old[:2], adv[:2], mask[:2] = lp[:2] - 1.5, -1.0, True  # ratio e^1.5 > c = 3 with A < 0: dual clip
    return lp, old, adv, mask


@pytest.mark.parametrize("with_weights", [False, True])
def test_ppo_clip_matches_loop(with_weights):
    lp, old, adv, mask = _inputs()
    w = torch.rand(64, dtype=torch.float64) * 2 if with_weights else None
    loss, m = ppo_clip(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, is_weights=w)
    expected, counts = _naive_ppo(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, 3.0,
                                  None if w is None else w.tolist())  # fmt: skip
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    n = int(mask.sum())
    assert counts["low"] > 0 and counts["high"] > 0 and counts["dual"] > 0  # the data exercises every branch
    assert m["clip_frac_low"] == pytest.approx(counts["low"] / n)
    assert m["clip_frac_high"] == pytest.approx(counts["high"] / n)
    assert m["dual_clip_frac"] == pytest.approx(counts["dual"] / n)
    ratios = [math.exp(a - b) for a, b, k in zip(lp.tolist(), old.tolist(), mask.tolist(), strict=True) if k]
    assert m["ratio_mean"] == pytest.approx(sum(ratios) / n)
    assert m["ratio_min"] == pytest.approx(min(ratios)) and m["ratio_max"] == pytest.approx(max(ratios))
    lr = [math.log(r) for r in ratios]
    assert m["approx_kl"] == pytest.approx(-sum(lr) / n)
    assert m["approx_kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in lr) / n)


def test_ppo_gradients_per_branch():
    # tokens: unclipped (A>0, r=1.1), clipped high (A>0, r=1.5), clipped low (A<0, r=0.5), dual clip (A<0, r=5)
    ratios = torch.tensor([1.1, 1.5, 0.5, 5.0], dtype=torch.float64)
    adv = torch.tensor([2.0, 2.0, -2.0, -2.0], dtype=torch.float64)
    old = torch.zeros(4, dtype=torch.float64)
    lp = torch.log(ratios).requires_grad_()
    loss, m = ppo_clip(lp, old, adv, torch.ones(4, dtype=torch.bool), clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0)
    torch.testing.assert_close(loss.detach(), torch.tensor([-2.2, -2.4, 1.6, 6.0], dtype=torch.float64))
    loss.sum().backward()
    # d(-A r)/dlogp = -A r where unclipped; 0 where any clip is active
    torch.testing.assert_close(lp.grad, torch.tensor([-2.2, 0.0, 0.0, 0.0], dtype=torch.float64))
    assert (m["clip_frac_high"], m["clip_frac_low"], m["dual_clip_frac"]) == (0.25, 0.25, 0.25)


def test_dual_clip_can_be_disabled():
    lp, old = torch.log(torch.tensor([5.0])), torch.zeros(1)
    loss, m = ppo_clip(lp, old, torch.tensor([-1.0]), torch.ones(1, dtype=torch.bool), clip_ratio_c=None)
    assert loss.item() == pytest.approx(5.0) and m["dual_clip_frac"] == 0.0


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
def test_extreme_ratios_are_finite(name):
    lp = torch.tensor([0.0, -60.0, -5.0, -1.0], requires_grad=True)
    old = torch.tensor([-50.0, -10.0, -5.0, 49.0])  # logp - old = +50, -50, 0, -50
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    seq = torch.tensor([0, 1, 2, 3])
    loss, m = POLICY_LOSSES[name](lp, old, adv, torch.ones(4, dtype=torch.bool), seq_ids=seq)
    agg = aggregate(loss, torch.ones(4, dtype=torch.bool), "token-mean")
    agg.backward()
    assert torch.isfinite(loss).all() and torch.isfinite(lp.grad).all()
    assert all(math.isfinite(v) for v in m.finalize().values())
    assert m["ratio_max"] == pytest.approx(math.exp(20), rel=1e-5)


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_empty_mask_gives_zero_loss_not_nan(name, mode):
    lp = torch.randn(6, requires_grad=True)
    mask = torch.zeros(6, dtype=torch.bool)
    loss, m = POLICY_LOSSES[name](lp, torch.randn(6), torch.randn(6), mask, seq_ids=torch.zeros(6, dtype=torch.long))
    out = aggregate(loss, mask, mode, max_length=8)
    out.backward()
    assert out.item() == 0.0 and torch.equal(lp.grad, torch.zeros(6))
    metrics = m.finalize()
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_frac_low"] == 0.0 and metrics["approx_kl"] == 0.0


def _pack(seed=3):
    """One packed row: 3 sequences of different lengths, prompt tokens unmasked, trailing padding."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.tensor([0] * 5 + [1] * 7 + [2] * 4 + [-1] * 3)
    mask = torch.tensor([0, 0, 1, 1, 1] + [0, 1, 1, 1, 1, 1, 1] + [0, 1, 1, 0] + [0, 0, 0]).bool()
    n = seq.numel()
    lp = -torch.rand(n, generator=g, dtype=torch.float64)
    # ratios close to 1 (GSPO's regime): sequence 0 above 1 + 4e-4, sequence 1 near 1, sequence 2 below 1 - 3e-4
    offset = torch.tensor([1e-3, 0.0, -1e-3, 0.0], dtype=torch.float64)[seq]
    old = lp - offset + torch.randn(n, generator=g, dtype=torch.float64) * 1e-4
    seq_adv = torch.tensor([1.0, -0.5, 2.0, 0.0], dtype=torch.float64)
    adv = torch.where(seq >= 0, seq_adv[seq], 0.0)
    return lp, old, adv, mask, seq


def test_gspo_matches_sequence_loop_and_sequence_gradient():
    lp, old, adv, mask, seq = _pack()
    lo, hi = 3e-4, 4e-4
    x = lp.clone().requires_grad_()
    loss, m = gspo(x, old, adv, mask, clip_low=lo, clip_high=hi, seq_ids=seq)
    # naive: s_i from a python loop over each sequence's masked tokens
    expected, clipped = [0.0] * len(lp), 0
    for i in range(3):
        toks = [t for t in range(len(lp)) if seq[t] == i and mask[t]]
        s = math.exp(sum(lp[t].item() - old[t].item() for t in toks) / len(toks))
        a = adv[toks[0]].item()
        val = max(-a * s, -a * min(max(s, 1 - lo), 1 + hi))
        clipped += len(toks) * (-a * min(max(s, 1 - lo), 1 + hi) > -a * s)
        for t in toks:
            expected[t] = val
    torch.testing.assert_close(loss.detach(), torch.tensor(expected, dtype=torch.float64))
    assert 0 < clipped < int(mask.sum())  # some sequences clipped, some not

    # GSPO-token + seq-mean-token-mean has the gradient of the sequence-level GSPO objective
    aggregate(loss, mask, "seq-mean-token-mean", seq_ids=seq).backward()
    y = lp.clone().requires_grad_()
    total = 0.0
    for i in range(3):
        sel = (seq == i) & mask
        s = torch.exp((y[sel] - old[sel]).mean())
        a = adv[sel][0]
        total = total + torch.maximum(-a * s, -a * torch.clamp(s, 1 - lo, 1 + hi))
    (total / 3).backward()
    torch.testing.assert_close(x.grad, y.grad)


def test_gspo_with_is_weights_and_registry():
    lp, old, adv, mask, seq = _pack()
    w = torch.rand(len(lp), dtype=torch.float64)
    plain, _ = gspo(lp, old, adv, mask, seq_ids=seq)
    weighted, _ = gspo(lp, old, adv, mask, seq_ids=seq, is_weights=w)
    torch.testing.assert_close(weighted, plain * w)
    assert POLICY_LOSSES["vanilla"] is ppo_clip and POLICY_LOSSES["ppo_clip"] is ppo_clip
    assert POLICY_LOSSES["gspo"] is gspo
    with pytest.raises(ValueError, match="gspo, ppo_clip, vanilla"):
        policy_loss("ppo", lp, old, adv, mask)


def _naive_agg(loss, mask, seq, mode, max_length, global_tokens=None, global_seqs=None):
    loss, mask, seq = loss.tolist(), mask.tolist(), seq.tolist()
    if mode == "token-mean":
        denom = global_tokens if global_tokens is not None else sum(mask)
        return sum(v for v, k in zip(loss, mask, strict=True) if k) / max(denom, 1)
    per_seq = {}
    for v, k, s in zip(loss, mask, seq, strict=True):
        if k and s >= 0:
            per_seq.setdefault(s, []).append(v)
    vals = []
    for toks in per_seq.values():
        if mode == "seq-mean-token-mean":
            vals.append(sum(toks) / len(toks))
        elif mode == "seq-mean-token-sum":
            vals.append(sum(toks))
        else:
            vals.append(sum(toks) / max_length)
    denom = global_seqs if global_seqs is not None else len(per_seq)
    return sum(vals) / max(denom, 1)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_matches_loop_and_adds_over_micro_batches(mode):
    lp, old, adv, mask, seq = _pack()
    per_token = torch.randn(len(lp), dtype=torch.float64)
    per_token[~mask] = float("nan")  # values outside the mask never reach the result
    got = aggregate(per_token, mask, mode, seq_ids=seq, max_length=16)
    assert got.item() == pytest.approx(_naive_agg(per_token, mask, seq, mode, 16))
    # two micro-batches with global denominators add up to the whole batch
    cut = 12  # between sequence 1 and 2
    tokens, seqs = mask.sum(), 3
    parts = [
        aggregate(per_token[s], mask[s], mode, global_tokens=tokens, seq_ids=seq[s], max_length=16, global_seqs=seqs)
        for s in (slice(0, cut), slice(cut, None))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(got.item())


def test_aggregate_rows_without_seq_ids_and_errors():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]]).bool()
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6.0 + 4.0) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", max_length=4).item() == pytest.approx(10.0 / 4 / 2)
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10.0 / 4)
    assert aggregate(loss, mask, "token-mean", global_tokens=torch.tensor(8)).item() == pytest.approx(10.0 / 8)
    with pytest.raises(ValueError, match="max_length"):
        aggregate(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(loss, mask, "sum")


def test_metrics_merge_over_micro_batches_equals_whole():
    lp, old, adv, mask = _inputs(40, seed=5)
    _, whole = ppo_clip(lp, old, adv, mask)
    _, a = ppo_clip(lp[:15], old[:15], adv[:15], mask[:15])
    _, b = ppo_clip(lp[15:], old[15:], adv[15:], mask[15:])
    merged = a.merge(b).finalize()
    for k, v in whole.finalize().items():
        assert merged[k] == pytest.approx(v), k


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
def test_approx_kl_is_unclamped_mean_of_old_minus_logp_with_an_outlier(name):
    """approx_kl = mean over masked tokens of (old - logp), not clamped: one outlier token (old - logp = 45, beyond the
    +-20 clamp of the ratio) must show in full, as in the trainer's own ratio statistics (issue 17.2)."""
    lp = torch.tensor([-1.0, -2.0, -50.0, -0.5, -3.0, -1.5], dtype=torch.float64)
    old = torch.tensor([-1.1, -1.9, -5.0, -0.5, -9.0, -1.4], dtype=torch.float64)  # token 2: old - logp = 45
    mask = torch.tensor([1, 1, 1, 1, 0, 1]).bool()  # token 4 (masked) must not count
    seq = torch.tensor([0, 0, 0, 1, 1, 1])
    _, m = POLICY_LOSSES[name](lp, old, torch.ones(6, dtype=torch.float64), mask, seq_ids=seq)
    pairs = [(o - p) for p, o, k in zip(lp.tolist(), old.tolist(), mask.tolist(), strict=True) if k]
    assert m["approx_kl"] == pytest.approx(sum(pairs) / len(pairs), rel=1e-12)
    assert m["approx_kl"] > 8.0  # (45 + small) / 5; the clamped value would be (20 + small) / 5
    # k3 stays finite: exp(x) - 1 - x on x = clamp(logp - old, +-20)
    k3 = [math.exp(max(-d, -20.0)) - 1 - max(-d, -20.0) for d in pairs]
    assert m["approx_kl_k3"] == pytest.approx(sum(k3) / len(k3), rel=1e-12)


def _naive_gspo_sequence_clips(lp, old, adv, mask, seq, lo, hi):
    """GSPO (Zheng et al. 2025) eq. 5-7 per sequence with python floats: s_i = exp(mean_t (logp - old)); the clip is
    active where the clipped term is the larger loss: A_i < 0 and s_i < 1 - lo, or A_i > 0 and s_i > 1 + hi."""
    ratios, low, high = [], 0, 0
    for i in sorted({int(q) for q, k in zip(seq, mask, strict=True) if k and q >= 0}):
        toks = [t for t in range(len(lp)) if int(seq[t]) == i and mask[t]]
        s = math.exp(sum(float(lp[t]) - float(old[t]) for t in toks) / len(toks))
        a = float(adv[toks[0]])
        ratios.append(s)
        low += a < 0 and s < 1 - lo
        high += a > 0 and s > 1 + hi
    n = len(ratios)
    return {"clip_frac_low": low / n, "clip_frac_high": high / n, "ratio_mean": sum(ratios) / n,
            "ratio_min": min(ratios), "ratio_max": max(ratios)}  # fmt: skip


def test_gspo_metrics_are_sequence_clip_fractions_with_gspo_range():
    """GSPO clips sequence ratios: its clip/ratio metrics are over sequences, with its own (tiny) clip range
    (issue 17.4); a token count would weight long sequences more and a PPO range would never fire."""
    lp, old, adv, mask, seq = _pack()
    adv = torch.where(seq == 2, -2.0, adv)  # sequence 2 (ratio < 1 - lo) gets A < 0: clipped low
    lo, hi = 3e-4, 4e-4
    _, m = gspo(lp, old, adv, mask, clip_low=lo, clip_high=hi, seq_ids=seq)
    expected = _naive_gspo_sequence_clips(lp, old, adv, mask, seq, lo, hi)
    assert expected["clip_frac_low"] == pytest.approx(1 / 3) and expected["clip_frac_high"] == pytest.approx(1 / 3)
    for k, v in expected.items():
        assert m[k] == pytest.approx(v, rel=1e-12), k
    assert m["dual_clip_frac"] == 0.0
