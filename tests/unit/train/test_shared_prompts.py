"""Shared-prompt packs (the n samples of a prompt computed once) give the logprobs, losses and gradients of the
unshared layout, and their bookkeeping (rows, token and sequence counts, positions) is that of the samples."""

import pytest
import torch

from rlpipe.config import AlgoConfig
from rlpipe.data.packing import SHARED_PREFIX, SequenceItem, pack_sequences, pad_pack_to_length, scatter_to_rows
from rlpipe.errors import DataError
from rlpipe.models.packed import check_packed_positions, token_logprobs
from rlpipe.models.packed_attention import PACKED_SDPA
from rlpipe.models.tiny import TinyModelConfig, build_tiny_model
from rlpipe.train.objective import StepSums, rl_microbatch_loss
from rlpipe.train.policy import PolicyModel

VOCAB = 64


def _groups(spec=((5, (3, 1, 4)), (2, (2, 2)), (1, (3, 2)), (7, (1,)))) -> list[SequenceItem]:
    """Groups of samples (consecutive rows) that share a prompt: (prompt length, response lengths)."""
    gen = torch.Generator().manual_seed(5)
    items, row = [], 0
    for p, responses in spec:
        prompt = torch.randint(3, VOCAB, (p,), generator=gen).tolist()
        for r in responses:
            resp = torch.randint(3, VOCAB, (r,), generator=gen).tolist()
            items.append(SequenceItem(prompt, resp, advantage=float(torch.randn(1, generator=gen)),
                                      rollout_logprobs=[-0.5] * r, row=row))  # fmt: skip
            row += 1
    return items


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request):
    m = build_tiny_model(TinyModelConfig(arch=request.param, hidden_size=32, intermediate_size=64), VOCAB, seed=0)
    m.set_attn_implementation(PACKED_SDPA)
    return m


def test_layout_shares_prompt_once_per_group():
    items = _groups()
    (shared,) = pack_sequences(items, 128, 0, pad_to_max_length=False, share_prompts=True)
    (plain,) = pack_sequences(items, 128, 0, pad_to_max_length=False)
    # prompt 5 x3 and 2 x2 are shared (P-1 tokens once + 1 per sample); prompt 1 cannot be split, 7 is a single.
    assert shared.length == plain.length - (2 * 4) - (1 * 1)
    assert (shared.seq_index == SHARED_PREFIX).sum() == 4 + 1
    assert shared.num_sequences == plain.num_sequences == len(items)
    assert shared.num_sequence_tokens == plain.num_sequence_tokens == sum(it.length for it in items)
    assert shared.num_label_tokens == plain.num_label_tokens
    assert shared.num_tokens < plain.num_tokens
    check_packed_positions(shared.position_ids, shared.cu_seq_lens, shared.prefix_of)
    with pytest.raises(DataError, match="position_ids"):
        check_packed_positions(shared.position_ids, shared.cu_seq_lens)  # the restarts after a shared prompt
    assert plain.prefix_of is None


def test_shared_logprobs_and_gradients_equal_unshared(model):
    items = _groups()
    (shared,) = pack_sequences(items, 128, 0, pad_to_max_length=False, share_prompts=True)
    (plain,) = pack_sequences(items, 128, 0, pad_to_max_length=False)
    per_row, grads = [], []
    for pack in (shared, plain):
        model.zero_grad(set_to_none=True)
        lp = token_logprobs(model, pack, chunk_size=8)
        rows = scatter_to_rows([pack], [lp], len(items))
        weights = torch.tensor([float(1 + r % 3) for r in range(len(items))])  # a per-row weighted loss
        loss = sum(
            weights[r] * torch.stack([lp[i] for i in _label_positions(pack, r)]).sum() for r in range(len(items))
        )
        loss.backward()
        per_row.append(rows)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    for a, b in zip(*per_row, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


def _label_positions(pack, row: int) -> list[int]:
    return ((pack.seq_index == row) & (pack.shifted_labels != -100)).nonzero().flatten().tolist()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_rl_loss_equal_across_layouts_and_budgets(model, agg):
    """Same loss and grads for shared vs unshared packs, also when a small budget splits a group over packs."""
    algo = AlgoConfig(loss_agg=agg)
    policy = PolicyModel(model, chunk_size=8)
    results = []
    for share, budget in [(False, 128), (True, 128), (True, 12)]:
        packs = pack_sequences(_groups(), budget, 0, pad_to_max_length=budget == 12, share_prompts=share)
        policy.zero_grad(set_to_none=True)
        tokens = torch.tensor(float(sum(p.num_label_tokens for p in packs)))
        seqs = torch.tensor(float(sum(p.num_sequences for p in packs)))
        total, sums = 0.0, StepSums("cpu")
        for pack in packs:
            with torch.no_grad():
                old = policy.logprobs(pack) - 0.1 * pack.advantages
            loss = rl_microbatch_loss(policy.logprobs(pack), pack, old, None, None, algo, tokens, seqs, 8, sums)
            loss.backward()
            total += float(loss.detach())
        results.append((total, [p.grad.clone() for p in policy.parameters()], len(packs)))
    policy.zero_grad(set_to_none=True)
    assert results[2][2] > 1  # the small budget really split the batch
    for total, grads, _ in results[1:]:
        assert total == pytest.approx(results[0][0], rel=1e-5)
        for g, g0 in zip(grads, results[0][1], strict=True):
            torch.testing.assert_close(g, g0, rtol=1e-4, atol=1e-6)


def test_group_longer_than_budget_is_split_with_its_own_prefix():
    items = _groups(((6, (4, 4, 4, 4)),))
    packs = pack_sequences(items, 16, 0, share_prompts=True)  # 5 + 4 x 5 = 25 > 16: two units of 5 + 2 x 5
    assert len(packs) == 2
    assert [int((p.seq_index == SHARED_PREFIX).sum()) for p in packs] == [5, 5]
    assert sorted(r for p in packs for r in set(p.seq_index.tolist()) if r >= 0) == [0, 1, 2, 3]


def test_padding_a_shared_pack_keeps_its_prefix_map(model):
    items = _groups()
    (pack,) = pack_sequences(items, 128, 0, pad_to_max_length=False, share_prompts=True)
    padded = pad_pack_to_length(pack, pack.length + 5, 0)
    assert padded.prefix_of.numel() == padded.cu_seq_lens.numel() - 1
    torch.testing.assert_close(token_logprobs(model, padded)[: pack.length], token_logprobs(model, pack))


def test_shared_pack_needs_the_packed_attention():
    m = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64), VOCAB, seed=0)
    (pack,) = pack_sequences(_groups(), 128, 0, share_prompts=True)
    with pytest.raises(DataError, match="shared-prompt packs need"):
        token_logprobs(m, pack)
