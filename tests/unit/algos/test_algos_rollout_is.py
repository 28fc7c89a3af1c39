"""Rollout IS weights, their metrics and the mismatch metrics against naive per-sequence python loops."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rlpipe.algos.rollout_is import mismatch_metrics, rollout_is_weights


def _batch(seed=0, scale=0.4):
    """A pack of 4 sequences (one fully masked out) with padding; old vs rollout logprobs differ by ~scale."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.tensor([0] * 6 + [1] * 5 + [2] * 3 + [3] * 6 + [-1] * 2)
    mask = torch.tensor([0, 1, 1, 1, 1, 1] + [0, 1, 1, 1, 1] + [0, 0, 0] + [0, 1, 1, 1, 1, 1] + [0, 0]).bool()
    n = seq.numel()
    roll = -torch.rand(n, generator=g, dtype=torch.float64) * 2
    old = roll + torch.randn(n, generator=g, dtype=torch.float64) * scale
    return old, roll, mask, seq


def _naive(old, roll, mask, seq, level, mode, upper, lower, veto):
    """Weights per token with python loops, plus raw weights, per-token masked flags and vetoed sequences."""
    old, roll, mask, seq = old.tolist(), roll.tolist(), mask.tolist(), seq.tolist()
    lower = 1 / upper if lower is None else lower
    seqs = sorted({s for s, k in zip(seq, mask, strict=True) if k and s >= 0})
    lam = {s: [o - r for o, r, k, q in zip(old, roll, mask, seq, strict=True) if k and q == s] for s in seqs}
    raw, w, masked = [0.0] * len(old), [0.0] * len(old), [False] * len(old)
    vetoed = {s for s in seqs if veto is not None and any(math.exp(x) < veto for x in lam[s])}
    for t in range(len(old)):
        if not mask[t]:
            continue
        if level == "token":
            x = old[t] - roll[t]
        elif level == "sequence":
            x = sum(lam[seq[t]])
        else:
            x = sum(lam[seq[t]]) / len(lam[seq[t]])
        r = math.exp(min(max(x, -20.0), 20.0))
        raw[t] = r
        v = r
        if mode in ("mask", "both") and not lower <= r <= upper:
            v, masked[t] = 0.0, True
        if mode in ("truncate", "both"):
            v = min(v, upper)
        if seq[t] in vetoed:
            v = 0.0
        w[t] = v
    return raw, w, masked, vetoed, seqs


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask", "both"])
def test_weights_and_metrics_match_loop(level, mode):
    old, roll, mask, seq = _batch()
    upper = 1.5
    w, m = rollout_is_weights(old, roll, mask, level=level, mode=mode, upper=upper, seq_ids=seq)
    raw, expected, masked, _, seqs = _naive(old, roll, mask, seq, level, mode, upper, None, None)
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64))
    tok = [t for t in range(len(raw)) if mask[t]]
    r = [raw[t] for t in tok]
    f = [expected[t] for t in tok]
    assert m["rollout_is_mean"] == pytest.approx(statistics.mean(r))
    assert m["rollout_is_std"] == pytest.approx(statistics.stdev(r))
    assert m["rollout_is_min"] == pytest.approx(min(r)) and m["rollout_is_max"] == pytest.approx(max(r))
    ess = sum(f) ** 2 / (len(f) * sum(x * x for x in f)) if any(f) else 0.0
    assert m["rollout_is_eff_sample_size"] == pytest.approx(ess)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(sum(x > upper for x in r) / len(r))
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(sum(x < 1 / upper for x in r) / len(r))
    assert m["rollout_is_masked_fraction"] == pytest.approx(sum(masked[t] for t in tok) / len(tok))
    seq_masked = {seq[t].item() for t in tok if masked[t]}
    assert m["rollout_is_seq_masked_fraction"] == pytest.approx(len(seq_masked) / len(seqs))
    assert m["rollout_is_veto_fraction"] == 0.0
    if mode == "truncate":
        assert m["rollout_is_masked_fraction"] == 0.0
    else:
        assert 0 < m["rollout_is_masked_fraction"] < 1  # the data exercises masking


def test_veto_zeroes_whole_sequences():
    old, roll, mask, seq = _batch(seed=1, scale=1.0)
    w, m = rollout_is_weights(old, roll, mask, level="token", mode="truncate", upper=2.0, veto_threshold=0.3,
                              seq_ids=seq)  # fmt: skip
    _, expected, _, vetoed, seqs = _naive(old, roll, mask, seq, "token", "truncate", 2.0, None, 0.3)
    assert 0 < len(vetoed) < len(seqs)
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64))
    for s in vetoed:
        assert (w[seq == s] == 0).all()
    assert m["rollout_is_veto_fraction"] == pytest.approx(len(vetoed) / len(seqs))


def test_veto_count_and_eff_sample_size_with_some_sequences_vetoed():
    old, roll, mask, seq = _batch(seed=1, scale=1.0)
    w, m = rollout_is_weights(old, roll, mask, level="token", mode="truncate", upper=2.0, veto_threshold=0.3,
                              seq_ids=seq)  # fmt: skip
    _, expected, _, vetoed, seqs = _naive(old, roll, mask, seq, "token", "truncate", 2.0, None, 0.3)
    f = [x for x, k in zip(expected, mask.tolist(), strict=True) if k]
    assert m["rollout_is_veto_count"] == len(vetoed)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(sum(f) ** 2 / (len(f) * sum(x * x for x in f)))


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_every_sequence_vetoed_reports_zero_eff_sample_size(level):
    """Every weight 0 (all sequences vetoed) is no data: ESS (sum w)^2 / (N sum w^2) has no effective sample, so 0,
    not the 1.0 of a perfectly on-policy batch (issue 17.3); the veto count says how many sequences went."""
    old, roll, mask, seq = _batch(seed=2)
    old = torch.where(seq >= 0, roll - 5.0, old)  # every token ratio e^-5 < 0.1: every sequence is vetoed
    w, m = rollout_is_weights(old, roll, mask, level=level, mode="truncate", upper=2.0, veto_threshold=0.1,
                              seq_ids=seq)  # fmt: skip
    _, _, _, vetoed, seqs = _naive(old, roll, mask, seq, level, "truncate", 2.0, None, 0.1)
    assert vetoed == set(seqs) and len(seqs) == 3
    assert torch.equal(w, torch.zeros_like(w))
    assert m["rollout_is_eff_sample_size"] == 0.0
    assert m["rollout_is_veto_fraction"] == 1.0
    assert m["rollout_is_veto_count"] == 3.0


def test_explicit_lower_bound_and_outside_mask():
    old = torch.tensor([0.0, math.log(0.6), math.log(0.4), 5.0])
    roll = torch.zeros(4)
    mask = torch.tensor([True, True, True, False])
    w, _ = rollout_is_weights(old, roll, mask, level="token", mode="mask", upper=2.0, lower=0.5)
    torch.testing.assert_close(w, torch.tensor([1.0, 0.6, 0.0, 0.0]))  # 0 outside the mask too


def test_extreme_log_ratios_are_finite_and_detached():
    old = torch.tensor([50.0, -50.0, 0.0, 0.0], requires_grad=True)
    roll = torch.tensor([0.0, 0.0, 0.0, 0.0])
    mask = torch.ones(4, dtype=torch.bool)
    seq = torch.tensor([0, 0, 1, 1])
    for level in ("token", "sequence", "geometric"):
        w, m = rollout_is_weights(old, roll, mask, level=level, mode="truncate", upper=1e12, seq_ids=seq)
        assert torch.isfinite(w).all() and not w.requires_grad
        assert all(math.isfinite(v) for v in m.values())
    w, m = rollout_is_weights(old, roll, mask, level="token", mode="truncate", upper=1e12)
    assert w[0].item() == pytest.approx(math.exp(20), rel=1e-5)  # log-space clamp at 20
    assert w[1].item() == pytest.approx(math.exp(-20), rel=1e-5)


def test_empty_mask_and_bad_arguments():
    z = torch.zeros(5)
    w, m = rollout_is_weights(z, z, torch.zeros(5, dtype=torch.bool), upper=2.0)
    assert torch.equal(w, z)
    assert m["rollout_is_mean"] == 1.0 and m["rollout_is_veto_fraction"] == 0.0
    assert m["rollout_is_eff_sample_size"] == 0.0 and m["rollout_is_veto_count"] == 0.0  # no data
    assert all(math.isfinite(v) for v in m.values())
    mm = mismatch_metrics(z, z, torch.zeros(5, dtype=torch.bool))
    assert mm["mismatch_kl"] == 0.0 and mm["mismatch_ppl_ratio"] == 1.0
    mask = torch.ones(5, dtype=torch.bool)
    for kwargs, msg in [
        ({"level": "seq"}, "level"),
        ({"mode": "clip"}, "mode"),
        ({"upper": 0.0}, "upper"),
        ({"upper": 2.0, "lower": 3.0}, "lower"),
        ({"veto_threshold": 0.0}, "veto"),
    ]:
        with pytest.raises(ValueError, match=msg):
            rollout_is_weights(z, z, mask, **kwargs)


def test_mismatch_metrics_match_loop():
    old, roll, mask, seq = _batch(seed=2)
    m = mismatch_metrics(old, roll, mask, seq)
    o, r, k, q = old.tolist(), roll.tolist(), mask.tolist(), seq.tolist()
    tok = [t for t in range(len(o)) if k[t]]
    assert m["mismatch_kl"] == pytest.approx(statistics.mean(r[t] - o[t] for t in tok))
    x = [min(max(o[t] - r[t], -20), 20) for t in tok]
    assert m["mismatch_k3_kl"] == pytest.approx(statistics.mean(math.exp(v) - 1 - v for v in x))
    seqs = sorted({q[t] for t in tok})
    mo = [statistics.mean(o[t] for t in tok if q[t] == s) for s in seqs]
    mr = [statistics.mean(r[t] for t in tok if q[t] == s) for s in seqs]
    diff = [b - a for a, b in zip(mo, mr, strict=True)]
    assert m["mismatch_training_ppl"] == pytest.approx(statistics.mean(math.exp(-v) for v in mo))
    assert m["mismatch_rollout_ppl"] == pytest.approx(statistics.mean(math.exp(-v) for v in mr))
    assert m["mismatch_log_ppl_diff"] == pytest.approx(statistics.mean(diff))
    assert m["mismatch_log_ppl_abs_diff"] == pytest.approx(statistics.mean(abs(v) for v in diff))
    assert m["mismatch_log_ppl_diff_max"] == pytest.approx(max(diff))
    assert m["mismatch_log_ppl_diff_min"] == pytest.approx(min(diff))
    assert m["mismatch_ppl_ratio"] == pytest.approx(statistics.mean(math.exp(v) for v in diff))


def test_metrics_reduce_exactly_over_two_ranks():
    """Splitting the batch over two 'ranks' and all-reducing the accumulators gives the whole batch's metrics."""
    old, roll, mask, seq = _batch(seed=3, scale=0.8)
    kw = dict(level="sequence", mode="both", upper=2.0, veto_threshold=0.2)
    _, whole = rollout_is_weights(old, roll, mask, seq_ids=seq, **kw)
    halves = [slice(0, 11), slice(11, None)]  # the cut falls between sequences
    parts = [rollout_is_weights(old[h], roll[h], mask[h], seq_ids=seq[h], **kw)[1] for h in halves]
    tensors = [p.to_tensors() for p in parts]
    reduced = parts[0].load_tensors(
        tensors[0][0] + tensors[1][0], torch.minimum(tensors[0][1], tensors[1][1]),
        torch.maximum(tensors[0][2], tensors[1][2]),
    )  # fmt: skip
    for k, v in whole.finalize().items():
        assert reduced[k] == pytest.approx(v), k
    mm_whole = mismatch_metrics(old, roll, mask, seq)
    mm = mismatch_metrics(old[halves[0]], roll[halves[0]], mask[halves[0]], seq[halves[0]]).merge(
        mismatch_metrics(old[halves[1]], roll[halves[1]], mask[halves[1]], seq[halves[1]])
    )
    for k, v in mm_whole.items():
        assert mm[k] == pytest.approx(v), k
