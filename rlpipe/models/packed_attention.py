"""Attention over a packed row that costs what its sequences cost, not (pack length)^2: "varlen" sdpa for CPU.

Why: with the stock ``sdpa`` backend a packed row gets a dense ``[L, L]`` block-diagonal mask, and the CPU kernel
computes every masked block (plus the mask itself: ``where``/``eq``/``bitwise_and`` per layer). For RL batches of
short responses that is most of a training step (profiled: ~50% of fwd+bwd of the tiny model at L=512).
``packed_sdpa_attention`` instead gathers each sequence of the pack into a row of a padded ``[S, H, max_len, D]``
batch (sequences are contiguous, ``cu_seq_lens`` gives the boundaries), runs causal sdpa on it and scatters the
valid rows back. Padding sits at the end of each row, so causal attention never lets a real query see it; padded
queries are dropped, so no gradient flows through them. The result equals block-diagonal attention exactly
(up to float summation order).

Shared prompts (``rlpipe.data.packing``, ``share_prompts=True``): a segment whose ``prefix_of`` entry (forward kwarg
``PREFIX_OF_KWARG``) names another segment also attends to all of that segment's keys, as if they preceded it. Its
row then holds ``[prefix keys | own keys]`` with an explicit mask (all valid prefix keys, causal own keys); a query
always sees its own first key, so no row is fully masked. Gradients reach the prefix keys and values from every
segment that reads them, which is what the unshared layout computes separately for each sample.

Registered with transformers as ``PACKED_SDPA``; because that name has no mask function, transformers builds no
mask at all for it. It needs ``cu_seq_lens_q`` in the forward kwargs (``rlpipe.models.packed`` passes it) and is
only for scoring packs: generation keeps the stock backend (it needs the KV cache and left-padding masks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from rlpipe.models.sequence_parallel import SP_GROUP_KWARG, group_size, ulysses_attention

PACKED_SDPA = "rlpipe_packed_sdpa"
PREFIX_OF_KWARG = "rlpipe_prefix_of"  # forward kwarg: per segment, the index of its shared-prompt segment or -1


def scoring_attention(attn_implementation: str, packed_attention: bool = True) -> str:
    """The backend for models that score packs: ``PACKED_SDPA`` in place of stock ``sdpa`` (when enabled)."""
    return PACKED_SDPA if packed_attention and attn_implementation == "sdpa" else attn_implementation


def pack_gather_index(cu_seq_lens: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index ``[S, max_len]`` into the packed row, validity mask ``[S, max_len]``) for ``cu_seq_lens`` ``[S+1]``."""
    cu = cu_seq_lens.to(torch.long)
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    offsets = torch.arange(max_len, device=cu.device)
    valid = offsets[None, :] < lengths[:, None]
    index = (starts[:, None] + offsets[None, :]).clamp(max=max(int(cu[-1]) - 1, 0))
    return index, valid


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, H, L, D]``, ``key/value [1, Hkv, L, D]`` -> ``[1, L, H, D]``.

    With an sp group of more than one rank (kwarg ``SP_GROUP_KWARG``, `train.sp_size`), q/k/v hold this rank's
    slice of the pack and the call runs as Ulysses attention (``rlpipe.models.sequence_parallel``)."""
    sp_group = kwargs.pop(SP_GROUP_KWARG, None)
    if group_size(sp_group) > 1:
        return ulysses_attention(packed_sdpa_attention, module, query, key, value, attention_mask, sp_group,
                                 dropout=dropout, scaling=scaling, **kwargs)  # fmt: skip
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        raise RuntimeError(
            f"{PACKED_SDPA} scores packed rows only (batch 1 with cu_seq_lens_q); use attn_implementation='sdpa' for "
            "generation or padded batches"
        )
    if attention_mask is not None:
        raise RuntimeError(f"{PACKED_SDPA} derives the mask from cu_seq_lens_q; got an explicit attention_mask")
    cu = cu.to(query.device)
    max_len = kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max())
    index, valid = pack_gather_index(cu, int(max_len))
    groups = query.shape[1] // key.shape[1]

    def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:  # [1, h, L, D] -> [S, h, len, D]
        return x[0][:, idx].permute(1, 0, 2, 3)

    q, k, v = gather(query, index), gather(key, index), gather(value, index)
    prefix_of = kwargs.get(PREFIX_OF_KWARG)
    mask = None
    if prefix_of is not None:
        p_index, p_valid = _prefix_gather_index(cu, prefix_of.to(query.device))
        k = torch.cat([gather(key, p_index), k], dim=2)
        v = torch.cat([gather(value, p_index), v], dim=2)
        causal = torch.ones(max_len, max_len, dtype=torch.bool, device=query.device).tril()
        mask = torch.cat(
            [p_valid[:, None, None, :].expand(-1, 1, max_len, -1), causal.expand(len(p_valid), 1, -1, -1)], dim=-1
        )  # [S, 1, max_len, P + max_len]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout if module.training else 0.0, is_causal=mask is None, scale=scaling
    )  # [S, H, max_len, D]
    return out.transpose(1, 2)[valid].unsqueeze(0), None  # valid rows in pack order: [1, L, H, D]


def _prefix_gather_index(cu: torch.Tensor, prefix_of: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index ``[S, P]`` of each segment's shared-prompt tokens, validity ``[S, P]``); P is the longest prefix.

    The rows of ``pack_gather_index`` for the prefix segments, picked per reading segment (none: all invalid)."""
    lengths = (cu[1:] - cu[:-1]).to(torch.long)
    has = prefix_of >= 0
    source = prefix_of.clamp(min=0)
    longest = int(torch.where(has, lengths[source], 0).max()) if prefix_of.numel() else 0
    index, valid = pack_gather_index(cu, longest)
    return index[source], valid[source] & has[:, None]


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
