"""A packed micro-batch gives the same RL loss and gradients as the same sequences one per micro-batch."""

import math

import pytest
import torch

from rlpipe.config import AlgoConfig
from rlpipe.data.packing import SequenceItem, pack_sequences, pad_sequences
from rlpipe.models.tiny import TinyModelConfig, build_tiny_model
from rlpipe.train.objective import StepSums, rl_microbatch_loss
from rlpipe.train.policy import PolicyModel


def _items():
    gen = torch.Generator().manual_seed(3)
    out = []
    for row, (p, r) in enumerate([(4, 3), (6, 5), (3, 2), (5, 4)]):
        ids = torch.randint(3, 60, (p + r,), generator=gen).tolist()
        out.append(SequenceItem(ids[:p], ids[p:], advantage=float(torch.randn(1, generator=gen)),
                                rollout_logprobs=[-1.0] * r, row=row))  # fmt: skip
    return out


def _loss_and_grads(policy, packs, algo):
    policy.zero_grad()
    tokens = torch.tensor(float(sum(p.num_label_tokens for p in packs)))
    seqs = torch.tensor(float(sum(p.num_sequences for p in packs)))
    total = 0.0
    sums = StepSums("cpu")
    for pack in packs:
        with torch.no_grad():
            old = policy.logprobs(pack) - 0.1 * pack.advantages  # a policy that moved a little
        loss = rl_microbatch_loss(policy.logprobs(pack), pack, old, None, None, algo, tokens, seqs, 8, sums)
        loss.backward()
        total += float(loss.detach())
    return total, [p.grad.clone() for p in policy.parameters()]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_packed_equals_unpacked(agg):
    torch.manual_seed(0)
    policy = PolicyModel(build_tiny_model(TinyModelConfig(), vocab_size=64, seed=0), chunk_size=7)
    algo = AlgoConfig(loss_agg=agg)
    packed = pack_sequences(_items(), 64, 0, pad_to_max_length=False)
    assert len(packed) == 1 and packed[0].num_sequences == 4
    unpacked = pad_sequences(_items(), 0)
    assert len(unpacked) == 4
    loss_p, grads_p = _loss_and_grads(policy, packed, algo)
    loss_u, grads_u = _loss_and_grads(policy, unpacked, algo)
    assert loss_p == pytest.approx(loss_u, rel=1e-5)
    for gp, gu in zip(grads_p, grads_u, strict=True):
        torch.testing.assert_close(gp, gu, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss_name", ["vanilla", "gspo"])
def test_trainer_and_policy_loss_log_the_same_approx_kl_with_an_outlier(loss_name):
    """The step's approx_kl (StepSums) and the policy loss's own metric are one definition: the unclamped mean of
    old - logp over response tokens; an outlier token (old - logp = 40) shows in both (issue 17.2)."""
    from rlpipe.algos.policy_loss import POLICY_LOSSES
    from rlpipe.data.packing import IGNORE_INDEX

    policy = PolicyModel(build_tiny_model(TinyModelConfig(), vocab_size=64, seed=0), chunk_size=7)
    algo = AlgoConfig(policy_loss=loss_name)
    (pack,) = pack_sequences(_items(), 64, 0, pad_to_max_length=False)
    mask = pack.shifted_labels != IGNORE_INDEX
    with torch.no_grad():
        logprobs = policy.logprobs(pack)
    old = logprobs + 0.01 * torch.arange(pack.length) * mask
    outlier = int(mask.nonzero()[3])
    old[outlier] = logprobs[outlier] + 40.0
    expected = [float(o) - float(p) for p, o, k in zip(logprobs, old, mask, strict=True) if k]
    expected = sum(expected) / len(expected)
    sums = StepSums("cpu")
    tokens, seqs = torch.tensor(float(pack.num_label_tokens)), torch.tensor(float(pack.num_sequences))
    rl_microbatch_loss(logprobs, pack, old, None, None, algo, tokens, seqs, 8, sums)
    step = sums.all_reduce_finalize()
    _, m = POLICY_LOSSES[loss_name](logprobs, old, pack.advantages, mask, seq_ids=pack.seq_index)
    assert step["approx_kl"] == pytest.approx(expected, rel=1e-5)
    assert m["approx_kl"] == pytest.approx(expected, rel=1e-5)


def test_gspo_step_metrics_are_sequence_clip_fractions():
    """Under GSPO the trainer logs what GSPO clips: sequence ratios s_i = exp(mean_t (logp - old)) against
    algo.clip_low/high, as a fraction of sequences (issue 17.4); checked against a python loop per sequence."""
    policy = PolicyModel(build_tiny_model(TinyModelConfig(), vocab_size=64, seed=0), chunk_size=7)
    algo = AlgoConfig(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4)
    items = _items()
    for item, a in zip(items, [1.0, -1.0, -0.5, 0.7], strict=True):
        item.advantage = a
    (pack,) = pack_sequences(items, 64, 0, pad_to_max_length=False)
    mask = pack.shifted_labels != -100
    with torch.no_grad():
        logprobs = policy.logprobs(pack)
    # sequence ratios e^{+1e-3}, e^{-1e-3}, e^{+1e-3}, e^{-1e-3}: all outside GSPO's range, clipped only for 0 and 1
    offset = torch.tensor([1e-3, -1e-3, 1e-3, -1e-3])[pack.seq_index.clamp(min=0)]
    old = torch.where(mask, logprobs - offset, logprobs)
    sums = StepSums("cpu")
    tokens, seqs = torch.tensor(float(pack.num_label_tokens)), torch.tensor(float(pack.num_sequences))
    rl_microbatch_loss(logprobs, pack, old, None, None, algo, tokens, seqs, 8, sums)
    step = sums.all_reduce_finalize()
    ratios, low, high = [], 0, 0
    for row in range(4):
        toks = [t for t in range(pack.length) if int(pack.seq_index[t]) == row and mask[t]]
        s = math.exp(sum(float(logprobs[t]) - float(old[t]) for t in toks) / len(toks))
        a = float(pack.advantages[toks[0]])
        ratios.append(s)
        low += a < 0 and s < 1 - 3e-4
        high += a > 0 and s > 1 + 4e-4
    assert (low, high) == (1, 1)
    assert step["clip_frac_low"] == pytest.approx(low / 4) and step["clip_frac_high"] == pytest.approx(high / 4)
    assert step["ratio_mean"] == pytest.approx(sum(ratios) / 4, rel=1e-6)
    assert step["ratio_min"] == pytest.approx(min(ratios), rel=1e-6)
    assert step["ratio_max"] == pytest.approx(max(ratios), rel=1e-6)
    assert step["dual_clip_frac"] == 0.0
