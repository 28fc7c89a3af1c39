"""Sequence parallelism building blocks (rlpipe.models.sequence_parallel): the token split, the all-to-all, the
token gather and Ulysses attention inside real HF models, on spawned gloo groups (no Ray).

The references are written independently of the sp code: the all-to-all against its definition (rank j receives
chunk j of every rank's tensor), the model paths against the same pack scored by one process without sp.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlpipe.data.packing import IGNORE_INDEX, mesh_shards, pack_sequences
from rlpipe.models.packed import expected_position_ids
from rlpipe.models.sequence_parallel import head_split, kv_repeats, local_bounds, pad_for_sp, sp_padded_length
from rlpipe.models.tiny import TinyModelConfig, create_tiny_model_dir
from tests.conftest import random_items


def test_pad_for_sp_appends_one_padding_segment_that_restarts_positions():
    items = random_items(1, 3, (2, 6))
    pack = pack_sequences(items, 64, pad_token_id=0, pad_to_max_length=False)[0]
    length = pack.length
    ids, pos, cu, labels, prefix = pad_for_sp(pack.input_ids, pack.position_ids, pack.cu_seq_lens,
                                              pack.shifted_labels, pack.prefix_of, 4)  # fmt: skip
    assert ids.numel() == sp_padded_length(length, 4) and ids.numel() % 4 == 0 and ids.numel() - length < 4
    if ids.numel() > length:
        assert cu.tolist() == pack.cu_seq_lens.tolist() + [ids.numel()]
        assert (labels[length:] == IGNORE_INDEX).all()
    assert torch.equal(pos, expected_position_ids(cu, ids.numel(), prefix))  # a valid packed row
    assert torch.equal(ids[:length], pack.input_ids) and torch.equal(labels[:length], pack.shifted_labels)


def test_local_bounds_tile_the_pack_and_refuse_unpadded_lengths():
    assert [local_bounds(12, r, 3) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    try:
        local_bounds(10, 0, 4)
    except ValueError as exc:
        assert "multiple of sp=4" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_head_split_is_as_even_as_possible_and_needs_a_head_per_rank():
    assert head_split(4, 2) == [2, 2] and head_split(9, 2) == [5, 4] and head_split(9, 4) == [3, 2, 2, 2]
    try:
        head_split(2, 3)
    except ValueError as exc:
        assert "sp=3" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_kv_repeats_give_every_rank_the_kv_heads_of_its_query_heads():
    """After repeating, rank r's share of kv heads must be exactly the kv heads its query heads read (GQA maps
    query head h to kv head h // (heads / kv_heads))."""
    for heads, kv, sp in [(4, 2, 2), (2, 1, 2), (4, 1, 4), (8, 2, 4), (12, 6, 4), (9, 3, 2), (9, 3, 3), (9, 1, 4)]:
        r = kv_repeats(heads, kv, sp)
        kv_owner = [h // r for h in range(kv * r)]  # repeated kv head -> original kv head
        q_sizes = head_split(heads, sp)
        kv_sizes = q_sizes if kv * r == heads else head_split(kv * r, sp)
        q0 = k0 = 0
        for qs, ks in zip(q_sizes, kv_sizes, strict=True):
            g = qs // ks
            assert qs % ks == 0
            for a in range(qs):  # local GQA inside the rank: local q head a reads local kv head a // g
                assert kv_owner[k0 + a // g] == (q0 + a) // (heads // kv), (heads, kv, sp)
            q0, k0 = q0 + qs, k0 + ks
    assert kv_repeats(4, 2, 2) == 1 and kv_repeats(2, 1, 2) == 2 and kv_repeats(9, 3, 2) == 3


def test_mesh_shards_give_an_sp_group_the_same_dp_shard():
    shards = mesh_shards(list(range(8)), dp_size=2, sp_size=2)
    assert shards == [[0, 2, 4, 6], [0, 2, 4, 6], [1, 3, 5, 7], [1, 3, 5, 7]]
    assert mesh_shards(list(range(4)), 2, 1) == [[0, 2], [1, 3]]


# ----------------------------------------------------------------------------- spawned
def _collectives(rank: int, sp: int) -> dict:
    from rlpipe.models.sequence_parallel import gather_tokens, heads_to_seq, seq_to_heads

    group = dist.new_group(list(range(sp)))
    # rank r holds x_r[h, t, 0] = 100 r + 10 h + t: 3 heads (split 2 + 1) x 2 tokens
    x = (100 * rank + 10 * torch.arange(3)[:, None] + torch.arange(2)[None, :]).double()[..., None].requires_grad_()
    y = seq_to_heads(x, [2, 1], group)
    weights = torch.arange(y.numel(), dtype=torch.float64).reshape(y.shape) + rank
    (y * weights).sum().backward()
    back = heads_to_seq(y.detach(), [2, 1], group)
    local = torch.arange(3, dtype=torch.float64) + 10 * rank
    local.requires_grad_()
    full = gather_tokens(local, group)
    (full * torch.arange(full.numel(), dtype=torch.float64)).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, "weights": weights, "back": back, "full": full.detach(),
            "local_grad": local.grad}  # fmt: skip


def _model_scores(rank: int, sp: int, model_dir: str, pack, activation_checkpointing: bool) -> dict:
    from rlpipe.models.loading import load_model
    from rlpipe.models.packed_attention import PACKED_SDPA
    from rlpipe.train.policy import PolicyModel, apply_layer_options

    group = dist.new_group(list(range(sp)))
    policy = PolicyModel(load_model(model_dir, attn_implementation=PACKED_SDPA), chunk_size=8)
    policy.hf.config.use_cache = False
    apply_layer_options(policy.hf, activation_checkpointing, False)
    policy.sp_group = group
    logprobs = policy.logprobs(pack)
    weights = torch.linspace(-1.0, 2.0, logprobs.numel())
    (logprobs * weights).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in policy.parameters()])
    dist.all_reduce(grads, group=group)  # each rank holds the partial gradient of its tokens
    return {"logprobs": logprobs.detach(), "grads": grads}


def _rank_main(rank: int, store: str, sp: int, jobs: list, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=sp)
    try:
        results = [_collectives(rank, sp)] + [_model_scores(rank, sp, *job) for job in jobs]
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path, sp: int, jobs: list) -> list[list[dict]]:
    out = str(tmp_path / "result")
    mp.spawn(_rank_main, args=(str(tmp_path / "store"), sp, jobs, out), nprocs=sp, join=True)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(sp)]


def _single_process(model_dir: str, pack, activation_checkpointing: bool) -> dict:
    from rlpipe.models.loading import load_model
    from rlpipe.models.packed_attention import PACKED_SDPA
    from rlpipe.train.policy import PolicyModel, apply_layer_options

    policy = PolicyModel(load_model(model_dir, attn_implementation=PACKED_SDPA), chunk_size=8)
    policy.hf.config.use_cache = False
    apply_layer_options(policy.hf, activation_checkpointing, False)
    logprobs = policy.logprobs(pack)
    (logprobs * torch.linspace(-1.0, 2.0, logprobs.numel())).sum().backward()
    return {"logprobs": logprobs.detach(), "grads": torch.cat([p.grad.reshape(-1) for p in policy.parameters()])}


def test_sp2_collectives_and_qwen2_llama_models_match_one_process(tmp_path):
    """One spawn of 2 ranks: the all-to-all and its gradient against their definition, the token gather, and
    per-token logprobs + summed gradients of real HF models against the unsplit pack: Qwen2 with 2 heads / 1 kv
    head (kv repeated), Llama with 4 heads / 2 kv heads (kv split), Llama with 3 heads / 3 kv heads (uneven 2 + 1
    split, like SmolLM2's 9 / 3 at sp 2), an odd pack length (padding), shared prompts, activation checkpointing
    (the all-to-alls recompute in backward)."""
    qwen = create_tiny_model_dir(tmp_path / "qwen2", TinyModelConfig(), seed=0)
    llama = create_tiny_model_dir(tmp_path / "llama", TinyModelConfig(arch="llama", num_heads=4, num_kv_heads=2), 1)
    odd = pack_sequences(random_items(4, 5, (3, 11)), 97, pad_token_id=0)[0]  # padded to 97
    base = random_items(5, 6, (3, 9))
    shared_items = [replace(it, prompt_ids=base[i // 3].prompt_ids) for i, it in enumerate(base)]  # 2 groups of 3
    shared = pack_sequences(shared_items, 128, pad_token_id=0, share_prompts=True, pad_to_max_length=False)[0]
    assert odd.length % 2 == 1 and shared.prefix_of is not None
    uneven = create_tiny_model_dir(tmp_path / "uneven", TinyModelConfig(arch="llama", hidden_size=48, num_heads=3,
                                                                        num_kv_heads=3), 2)  # fmt: skip
    jobs = [(qwen, odd, False), (llama, odd, False), (llama, shared, True), (qwen, shared, True), (uneven, odd, True)]
    ranks = _spawn(tmp_path, 2, jobs)

    c0, c1 = ranks[0][0], ranks[1][0]
    x = [(100 * r + 10 * torch.arange(3)[:, None] + torch.arange(2)[None, :]).double()[..., None] for r in range(2)]
    heads = [slice(0, 2), slice(2, 3)]
    for r, c in enumerate((c0, c1)):  # rank r: its heads of both ranks' tokens, rank 0's tokens first
        assert torch.equal(c["y"], torch.cat([x[0][heads[r]], x[1][heads[r]]], dim=1))
        assert torch.equal(c["back"], x[r])  # heads_to_seq inverts it
    # d/dx_j[h, t]: the weight that multiplied x_j[h, t] on the rank that received head h
    for j, c in enumerate((c0, c1)):
        want = torch.cat([ranks[h][0]["weights"][:, 2 * j : 2 * j + 2] for h in range(2)], dim=0)
        assert torch.equal(c["x_grad"], want)
        assert torch.equal(c["full"], torch.tensor([0.0, 1, 2, 10, 11, 12], dtype=torch.float64))
        assert torch.equal(c["local_grad"], torch.arange(3, dtype=torch.float64) + 3 * j)

    for i, (model_dir, pack, ac) in enumerate(jobs, start=1):
        ref = _single_process(model_dir, pack, ac)
        for r in range(2):
            got = ranks[r][i]
            assert got["logprobs"].shape == ref["logprobs"].shape
            torch.testing.assert_close(got["logprobs"], ref["logprobs"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["grads"], ref["grads"], rtol=1e-4, atol=1e-6)
