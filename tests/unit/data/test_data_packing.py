"""Packing: label/advantage/logprob alignment vs a naive per-sequence construction, scatter round trip, dp padding."""

from __future__ import annotations

import random

import pytest
import torch

from rlpipe.data.packing import (
    IGNORE_INDEX,
    SequenceItem,
    dp_shards,
    efficient_attn_ratio,
    pack_sequences,
    pad_pack_to_length,
    pad_sequences,
    scatter_to_rows,
)
from rlpipe.errors import DataError

PAD = 0


def make_items(n: int, seed: int, with_lp: bool = True, max_len: int = 12) -> list[SequenceItem]:
    rng = random.Random(seed)
    items = []
    for row in range(n):
        p = rng.randint(1, max_len // 2)
        r = rng.randint(1, max_len - p)
        resp = [rng.randint(1, 50) for _ in range(r)]
        items.append(
            SequenceItem(
                prompt_ids=[rng.randint(1, 50) for _ in range(p)],
                response_ids=resp,
                advantage=rng.uniform(-2, 2),
                rollout_logprobs=[-rng.random() for _ in range(r)] if with_lp else None,
                row=row,
            )
        )
    return items


def naive_layout(it: SequenceItem) -> tuple[list[int], list[int], list[float], list[float]]:
    """Straight from the contract: position t predicts t+1; values sit where their label is."""
    ids = it.prompt_ids + it.response_ids
    p, t_len = len(it.prompt_ids), len(ids)
    labels, adv, lps = [], [], []
    for t in range(t_len):
        if t + 1 < t_len and t + 1 >= p:
            labels.append(ids[t + 1])
            adv.append(it.advantage)
            lps.append(it.rollout_logprobs[t + 1 - p] if it.rollout_logprobs is not None else 0.0)
        else:
            labels.append(IGNORE_INDEX)
            adv.append(0.0)
            lps.append(0.0)
    return ids, labels, adv, lps


def segments(pack):
    b = pack.cu_seq_lens.tolist()
    return list(zip(b[:-1], b[1:], strict=True))


@pytest.mark.parametrize("pad_to_max", [True, False])
def test_alignment_against_naive(pad_to_max: bool) -> None:
    items = make_items(40, seed=1)
    packs = pack_sequences(items, 16, PAD, pad_to_max_length=pad_to_max)
    seen = []
    for pack in packs:
        assert pack.length <= 16 and (pack.length == 16 or not pad_to_max)
        assert pack.cu_seq_lens.dtype == torch.int32 and int(pack.cu_seq_lens[-1]) == pack.length
        assert pack.input_ids.dtype == torch.long and pack.advantages.dtype == torch.float32
        for start, end in segments(pack):
            assert pack.position_ids[start:end].tolist() == list(range(end - start))
            row = int(pack.seq_index[start])
            assert pack.seq_index[start:end].tolist() == [row] * (end - start)
            if row < 0:  # padding segment
                assert pack.input_ids[start:end].tolist() == [PAD] * (end - start)
                assert (pack.shifted_labels[start:end] == IGNORE_INDEX).all()
                assert (pack.advantages[start:end] == 0).all() and (pack.rollout_logprobs[start:end] == 0).all()
                continue
            ids, labels, adv, lps = naive_layout(items[row])
            assert pack.input_ids[start:end].tolist() == ids
            assert pack.shifted_labels[start:end].tolist() == labels
            torch.testing.assert_close(pack.advantages[start:end], torch.tensor(adv, dtype=torch.float32))
            torch.testing.assert_close(pack.rollout_logprobs[start:end], torch.tensor(lps, dtype=torch.float32))
            seen.append(row)
    assert sorted(seen) == list(range(40))
    assert sum(p.num_tokens for p in packs) == sum(it.length for it in items)
    assert sum(p.num_label_tokens for p in packs) == sum(len(it.response_ids) for it in items)


def test_first_fit_decreasing_is_tight_and_deterministic() -> None:
    lengths = [3, 5, 4, 5, 3]
    items = [SequenceItem(prompt_ids=[1] * (n - 1), response_ids=[2], row=i) for i, n in enumerate(lengths)]
    packs = pack_sequences(items, 11, PAD)
    assert len(packs) == 2
    assert [p.sequence_lengths() for p in packs] == [[5, 5], [4, 3, 3]]
    assert [p.seq_index[p.cu_seq_lens[:-1].long()].tolist() for p in packs] == [[1, 3, -1], [2, 0, 4, -1]]
    again = pack_sequences(items, 11, PAD)
    for a, b in zip(packs, again, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.seq_index, b.seq_index)


def test_efficient_attn_ratio() -> None:
    items = [SequenceItem(prompt_ids=[1] * 3, response_ids=[2], row=0), SequenceItem([1, 1], [2, 2], row=1)]
    (pack,) = pack_sequences(items, 10, PAD)
    assert pack.efficient_attn_ratio == pytest.approx((16 + 16) / 100)
    assert pack.num_sequences == 2
    moved = pack.to("cpu")
    assert moved is not pack and torch.equal(moved.input_ids, pack.input_ids) and moved.rollout_logprobs is None
    padded = pad_sequences(items, PAD)
    assert [p.efficient_attn_ratio for p in padded] == [1.0, 1.0]
    assert efficient_attn_ratio([pack, pack]) == pytest.approx(0.32)


@pytest.mark.parametrize("dp_size", [1, 2, 3, 8])
def test_dp_padding_and_sharding(dp_size: int) -> None:
    items = make_items(9, seed=4)
    base = pack_sequences(items, 16, PAD)
    packs = pack_sequences(items, 16, PAD, dp_size=dp_size)
    assert len(packs) % dp_size == 0 and len(packs) - len(base) < dp_size
    for dummy in packs[len(base) :]:
        assert dummy.num_tokens == 0 and dummy.num_label_tokens == 0 and dummy.length == 16
        assert (dummy.seq_index == -1).all() and dummy.cu_seq_lens.tolist() == [0, 16]
        assert dummy.rollout_logprobs is not None
    shards = dp_shards(packs, dp_size)
    assert len({len(s) for s in shards}) == 1
    assert sorted(id(p) for s in shards for p in s) == sorted(id(p) for p in packs)


def test_scatter_round_trip() -> None:
    items = make_items(25, seed=2)
    packs = pack_sequences(items, 16, PAD, dp_size=4)
    back = scatter_to_rows(packs, [p.rollout_logprobs for p in packs], num_rows=27)
    for it in items:
        assert back[it.row] == pytest.approx(it.rollout_logprobs, abs=1e-6)
    assert back[25] == [] and back[26] == []
    # values computed per position (e.g. a model's logprobs) land on the right rows
    adv = scatter_to_rows(packs, [p.advantages for p in packs], num_rows=25)
    assert all(adv[it.row] == pytest.approx([it.advantage] * len(it.response_ids)) for it in items)
    with pytest.raises(DataError):
        scatter_to_rows(packs, [p.advantages for p in packs], num_rows=10)
    with pytest.raises(DataError):
        scatter_to_rows(packs, [p.advantages[:-1] for p in packs], num_rows=25)


def test_bad_items_raise_naming_row() -> None:
    long = SequenceItem(prompt_ids=[1] * 10, response_ids=[2] * 7, row=5)
    with pytest.raises(DataError) as err:
        pack_sequences([SequenceItem([1], [2], row=0), long], 16, PAD)
    assert "row 5" in str(err.value) and "pack_max_length=16" in str(err.value)
    with pytest.raises(DataError, match="row 3"):
        pack_sequences([SequenceItem([1], [2, 3], rollout_logprobs=[0.0], row=3)], 16, PAD)
    with pytest.raises(DataError, match="row 1"):
        pack_sequences([SequenceItem([1], [2], rollout_logprobs=[0.0], row=0), SequenceItem([1], [2], row=1)], 16, PAD)
    with pytest.raises(DataError, match="twice"):
        pack_sequences([SequenceItem([1], [2], row=0), SequenceItem([1], [2], row=0)], 16, PAD)
    with pytest.raises(DataError, match="empty prompt"):
        pack_sequences([SequenceItem([], [2], row=0)], 16, PAD)
    assert pack_sequences([], 16, PAD, dp_size=2) == []


def test_padded_baseline_same_layout_and_stack() -> None:
    items = make_items(6, seed=3, with_lp=False)
    padded = pad_sequences(items, PAD, dp_size=4)
    longest = max(it.length for it in items)
    assert len(padded) == 8 and all(p.length == longest for p in padded)
    for it, pack in zip(items, padded[:6], strict=True):
        ids, labels, adv, _ = naive_layout(it)
        n = it.length
        assert pack.input_ids[:n].tolist() == ids and pack.shifted_labels[:n].tolist() == labels
        torch.testing.assert_close(pack.advantages[:n], torch.tensor(adv, dtype=torch.float32))
        assert pack.rollout_logprobs is None
        assert (pack.shifted_labels[n:] == IGNORE_INDEX).all()
    with pytest.raises(DataError):
        pad_sequences([SequenceItem([1] * 5, [2], row=0)], PAD, max_length=4)


def test_pad_pack_to_length() -> None:
    items = make_items(3, seed=5)
    (tight,) = pack_sequences(items, 40, PAD, pad_to_max_length=False)
    (full,) = pack_sequences(items, 40, PAD)
    grown = pad_pack_to_length(tight, 40, PAD)
    for name in (
        "input_ids",
        "position_ids",
        "cu_seq_lens",
        "shifted_labels",
        "advantages",
        "rollout_logprobs",
        "seq_index",
    ):
        assert torch.equal(getattr(grown, name), getattr(full, name)), name
    # growing a pack that already ends in padding widens that segment
    more = pad_pack_to_length(full, 44, PAD)
    assert more.cu_seq_lens.tolist()[:-1] == full.cu_seq_lens.tolist()[:-1] and int(more.cu_seq_lens[-1]) == 44
    pad_start = int(full.cu_seq_lens[-2])
    assert more.position_ids[pad_start:].tolist() == list(range(44 - pad_start))


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_balanced_packing_spreads_tokens_evenly(dp_size: int) -> None:
    """First-fit fills packs in turn (the last rank idles); balance=True evens them out over as few packs."""
    gen = torch.Generator().manual_seed(4)
    items = [
        SequenceItem(torch.randint(3, 50, (int(p),), generator=gen).tolist(), [7] * int(r), row=i)
        for i, (p, r) in enumerate(zip(torch.randint(2, 12, (60,), generator=gen), torch.randint(1, 9, (60,), generator=gen), strict=True))
    ]  # fmt: skip
    first_fit = pack_sequences(items, 256, 0, dp_size, pad_to_max_length=False)
    balanced = pack_sequences(items, 256, 0, dp_size, pad_to_max_length=False, balance=True)
    assert len(balanced) % dp_size == 0 and len(balanced) <= len(first_fit)
    loads = [p.num_tokens for p in balanced]
    assert max(loads) - min(loads) <= max(it.length for it in items)
    assert max(loads) < max(p.num_tokens for p in first_fit) or len(balanced) == 1
    assert sorted(r for p in balanced for r in set(p.seq_index.tolist()) if r >= 0) == list(range(60))
    assert pack_sequences([], 256, 0, dp_size, balance=True) == []
