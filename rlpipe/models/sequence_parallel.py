"""Sequence parallelism (`train.sp_size`): a pack's tokens split over the ranks of an sp group, Ulysses attention.

Layout. Every rank of an sp group receives the same pack. ``pad_for_sp`` appends a padding segment so the length
is a multiple of ``sp`` (positions restarting at 0, labels -100, so nothing attends to it and it scores nothing),
and rank ``r`` runs the decoder on the contiguous slice ``r`` of ``local_bounds`` (ids, positions and labels are
cut the same way; the full ``cu_seq_lens`` stays with every rank because attention needs it).

Attention (Jacobs et al. 2023, "DeepSpeed Ulysses"). q/k/v arrive sequence-sharded ``[1, H, L/sp, D]``;
``all_to_all`` turns them into head-sharded full sequences ``[1, H/sp, L, D]``, the packed attention runs on its
head group exactly as without sp, and a second all-to-all returns ``[1, L/sp, H, D]``. Grouped-query models:
kv heads are split when ``sp`` divides their number; otherwise each is repeated the fewest times that make the
count divisible (``kv_repeats``) — always possible when ``sp`` divides the query heads, which
``rlpipe.config_checks`` requires of the model.

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


def kv_repeats(num_kv_heads: int, sp: int) -> int:
    """How many times each kv head is repeated so ``sp`` divides the kv head count (1: split as is)."""
    return sp // math.gcd(num_kv_heads, sp)


class _AllToAll(torch.autograd.Function):
    """Split ``x`` into ``sp`` chunks along ``scatter_dim``, send chunk j to rank j, concatenate what arrives
    along ``gather_dim`` in rank order. Its gradient is the same exchange with the dims swapped."""

    @staticmethod
    def forward(ctx, x, scatter_dim: int, gather_dim: int, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    sp = dist.get_world_size(group)
    if x.shape[scatter_dim] % sp:
        raise ValueError(f"all_to_all: dim {scatter_dim} of {tuple(x.shape)} is not divisible by sp={sp}")
    send = torch.stack([c.contiguous() for c in x.chunk(sp, dim=scatter_dim)])  # [sp, ...chunk]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(list(recv.unbind(0)), dim=gather_dim)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Differentiable all-to-all over ``group`` (identity for a group of one)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


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
    sharded for the call, sequence sharded again on return ``[1, L/sp, H, D]`` (module doc)."""
    sp = dist.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % sp:
        raise ValueError(f"sequence parallelism: sp={sp} must divide the {heads} attention heads")
    repeats = kv_repeats(kv_heads, sp)
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    q, k, v = (all_to_all(t, 1, 2, group) for t in (query, key, value))  # [1, h/sp, L, D]
    out, weights = attention(module, q, k, v, attention_mask, **kwargs)  # [1, L, H/sp, D]
    return all_to_all(out, 1, 2, group), weights
