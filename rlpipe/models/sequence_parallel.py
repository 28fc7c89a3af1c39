"""Sequence parallelism (`train.sp_size`): a pack's tokens split over the ranks of an sp group, Ulysses attention.

Layout. Every rank of an sp group receives the same pack. ``pad_for_sp`` appends a padding segment so the length
is a multiple of ``sp`` (positions restarting at 0, labels -100, so nothing attends to it and it scores nothing),
and rank ``r`` runs the decoder on the contiguous slice ``r`` of ``local_bounds`` (ids, positions and labels are
cut the same way; the full ``cu_seq_lens`` stays with every rank because attention needs it).

Attention (Jacobs et al. 2023, "DeepSpeed Ulysses"). q/k/v arrive sequence-sharded ``[1, H, L/sp, D]``;
``seq_to_heads`` (an all-to-all) turns them into head-sharded full sequences ``[1, H/sp, L, D]``, the packed
attention runs on its head group exactly as without sp, and ``heads_to_seq`` returns ``[1, L/sp, H, D]``. When
``sp`` does not divide the query heads they are split as evenly as possible (``head_split``: SmolLM2's 9 heads
over 2 ranks are 5 + 4; gloo and nccl take uneven all-to-all splits); ``sp`` may not exceed them. Grouped-query
models: kv heads are split when ``sp`` divides both head counts, repeated the fewest times that make it divide
them when it divides the query heads only, and repeated up to the query heads (then split with them) otherwise
(``kv_repeats``).

Loss. Each rank scores its local tokens (the chunked LM head over ``L/sp`` tokens), then ``gather_tokens`` puts
the full ``[L]`` logprobs on every sp rank. Every sequence-level quantity (GSPO's sequence ratio, sequence-mean
aggregation, sequence IS weights, token-mean denominators) is then computed on whole sequences by the unchanged
loss code, so it is exact by construction; the sp ranks of a group compute the same loss, and the backward of
``gather_tokens`` hands each rank only the gradient of its own tokens. Parameter gradients are partial sums per
rank and are summed over the whole mesh (dp x sp) by the gradient reduction.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rlpipe.data.packing import IGNORE_INDEX

SP_GROUP_KWARG = "rlpipe_sp_group"  # forward kwarg: the sp process group the attention all-to-alls run over


def group_size(group) -> int:
    """Ranks in ``group`` (1 without a process group or without a group)."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def sp_padded_length(length: int, sp: int) -> int:
    """The pack length rounded up to a multiple of ``sp``."""
    return sp * math.ceil(length / sp)


def pad_for_sp(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    labels: torch.Tensor,
    prefix_of: torch.Tensor | None,
    sp: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pad a 1-D pack to a multiple of ``sp`` with one extra segment: ids 0, positions 0.., labels -100.

    No-op when the length already divides. The padding segment attends only to itself (its own ``cu_seq_lens``
    entry), so real tokens are unaffected; ``prefix_of`` gets -1 for it.
    """
    length = input_ids.numel()
    extra = sp_padded_length(length, sp) - length
    if extra == 0:
        return input_ids, position_ids, cu_seq_lens, labels, prefix_of
    dev = input_ids.device
    ids = torch.cat([input_ids, torch.zeros(extra, dtype=input_ids.dtype, device=dev)])
    pos = torch.cat([position_ids, torch.arange(extra, dtype=position_ids.dtype, device=dev)])
    cu = torch.cat([cu_seq_lens, cu_seq_lens.new_tensor([length + extra])])
    lab = torch.cat([labels, torch.full((extra,), IGNORE_INDEX, dtype=labels.dtype, device=dev)])
    if prefix_of is not None:
        prefix_of = torch.cat([prefix_of, prefix_of.new_tensor([-1])])
    return ids, pos, cu, lab, prefix_of


def local_bounds(length: int, rank: int, sp: int) -> tuple[int, int]:
    """[start, end) of rank ``rank``'s tokens in a pack of ``length`` (a multiple of ``sp``)."""
    if length % sp:
        raise ValueError(f"pack length {length} is not a multiple of sp={sp} (pad_for_sp first)")
    n = length // sp
    return rank * n, (rank + 1) * n


def head_split(heads: int, sp: int) -> list[int]:
    """Query heads per sp rank: as even as possible (the first ``heads % sp`` ranks take one more)."""
    if not 1 <= sp <= heads:
        raise ValueError(f"sequence parallelism: sp={sp} needs 1 <= sp <= the {heads} attention heads")
    return [heads // sp + (r < heads % sp) for r in range(sp)]


def kv_repeats(num_heads: int, num_kv_heads: int, sp: int) -> int:
    """How many times each kv head is repeated before the exchange. sp divides the query heads: the fewest
    repeats that make it divide the kv heads too (1: split as is); otherwise the kv heads are repeated up to the
    query heads and split with them (each rank's uneven query heads then have their own kv heads)."""
    if num_heads % sp:
        return num_heads // num_kv_heads
    return sp // math.gcd(num_kv_heads, sp)


def _seq_to_heads(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """``[H, L/sp, D]`` of this rank's tokens -> ``[sizes[rank], L, D]``: its heads over every rank's tokens."""
    sp, rank = len(sizes), dist.get_rank(group)
    h, n = sizes[rank], x.shape[1]
    recv = x.new_empty((sp * h, *x.shape[1:]))
    dist.all_to_all_single(recv, x.contiguous(), output_split_sizes=[h] * sp, input_split_sizes=sizes, group=group)
    return recv.view(sp, h, n, -1).transpose(0, 1).reshape(h, sp * n, -1)


def _heads_to_seq(y: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Inverse of ``_seq_to_heads``: ``[sizes[rank], L, D]`` -> ``[H, L/sp, D]``."""
    sp, h = len(sizes), y.shape[0]
    n = y.shape[1] // sp
    send = y.reshape(h, sp, n, -1).transpose(0, 1).reshape(sp * h, n, -1)
    recv = y.new_empty((sum(sizes), n, y.shape[-1]))
    dist.all_to_all_single(recv, send, output_split_sizes=sizes, input_split_sizes=[h] * sp, group=group)
    return recv


class _SeqToHeads(torch.autograd.Function):
    """The Ulysses exchange; a permutation of elements across ranks, so its gradient is the inverse exchange."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _seq_to_heads(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.sizes, ctx.group), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _heads_to_seq(y, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.sizes, ctx.group), None, None


def seq_to_heads(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Differentiable ``[H, L/sp, D]`` (sequence-sharded) -> ``[sizes[rank], L, D]`` (head-sharded) over ``group``."""
    return _SeqToHeads.apply(x, sizes, group)


def heads_to_seq(y: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Differentiable inverse of ``seq_to_heads``."""
    return _HeadsToSeq.apply(y, sizes, group)


class _GatherTokens(torch.autograd.Function):
    """Concatenate every rank's ``[n, ...]`` slice in rank order. Every rank computes the same loss from the
    result, so the gradient of rank r's slice is just slice r of the incoming gradient (no sum over ranks)."""

    @staticmethod
    def forward(ctx, local, group):
        sp = dist.get_world_size(group)
        ctx.rank, ctx.n = dist.get_rank(group), local.shape[0]
        parts = [torch.empty_like(local) for _ in range(sp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None


def gather_tokens(local: torch.Tensor, group) -> torch.Tensor:
    """The full token tensor from the sp ranks' equal-length slices (see ``_GatherTokens`` for its gradient)."""
    if group_size(group) == 1:
        return local
    return _GatherTokens.apply(local, group)


def ulysses_attention(attention, module, query, key, value, attention_mask, group, **kwargs):
    """``attention`` (a transformers attention function) on sequence-sharded q/k/v ``[1, h, L/sp, D]``: heads
    sharded for the call (``head_split``), sequence sharded again on return ``[1, L/sp, H, D]`` (module doc)."""
    sp = dist.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    repeats = kv_repeats(heads, kv_heads, sp)
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    q_sizes = head_split(heads, sp)
    kv_sizes = q_sizes if key.shape[1] == heads else head_split(key.shape[1], sp)
    q = seq_to_heads(query[0], q_sizes, group).unsqueeze(0)  # [1, h_rank, L, D]
    k, v = (seq_to_heads(t[0], kv_sizes, group).unsqueeze(0) for t in (key, value))
    out, weights = attention(module, q, k, v, attention_mask, **kwargs)  # [1, L, h_rank, D]
    out = heads_to_seq(out[0].transpose(0, 1), q_sizes, group)  # [H, L/sp, D]
    return out.transpose(0, 1).unsqueeze(0), weights
