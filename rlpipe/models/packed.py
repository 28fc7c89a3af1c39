"""Forward over a packed row of sequences without attention across sequence boundaries.

How isolation is achieved (checked in transformers 5.24 ``masking_utils``): when the backbone gets
``attention_mask=None``, no KV cache (``use_cache=False``) and ``position_ids`` that restart at 0 for every
sequence, ``find_packed_sequence_indices`` detects the packed format and builds a block-diagonal causal mask
(sdpa/eager/flex), and flash-attention derives varlen ``cu_seqlens`` from the same position ids. With
``rlpipe.models.packed_attention.PACKED_SDPA`` (what the trainer uses in place of ``sdpa``) no mask is built and
attention runs per sequence from ``cu_seq_lens``. So no explicit 4D
mask is needed, and none is passed (a 4D mask would break flash-attention). The one requirement is that
``position_ids`` restart exactly at every ``cu_seq_lens`` boundary, which ``check_packed_positions`` enforces.

The model is taken as an argument and reached through ``get_decoder()`` / ``get_output_embeddings()`` so the same
code runs on a plain HF model and inside an FSDP2-wrapped module's forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlpipe.errors import DataError
from rlpipe.models.packed_attention import PACKED_SDPA, PREFIX_OF_KWARG
from rlpipe.models.sequence_parallel import (
    SP_GROUP_KWARG,
    gather_tokens,
    group_size,
    local_bounds,
    pad_for_sp,
)

if TYPE_CHECKING:
    from rlpipe.data.packing import Pack


def expected_position_ids(
    cu_seq_lens: torch.Tensor, length: int, prefix_of: torch.Tensor | None = None
) -> torch.Tensor:
    """Position ids that restart at every boundary of ``cu_seq_lens`` (``[num_segments + 1]``): at 0, or after the
    shared prompt named by ``prefix_of`` (``[num_segments]``, -1 = none)."""
    cu = cu_seq_lens.to(torch.long).cpu()
    lengths = cu[1:] - cu[:-1]
    if cu[0].item() != 0 or cu[-1].item() != length or (lengths < 0).any():
        raise DataError(
            f"cu_seq_lens {cu.tolist()} must start at 0, be non-decreasing and end at the pack length {length}",
            field="cu_seq_lens",
        )
    first = torch.zeros_like(lengths)
    if prefix_of is not None:
        source = prefix_of.to(torch.long).cpu()
        if source.numel() != lengths.numel() or (source >= torch.arange(source.numel())).any():
            raise DataError(
                f"prefix_of {source.tolist()} must name an earlier segment (or -1) for each of {lengths.numel()}",
                field="prefix_of",
            )
        first = torch.where(source >= 0, lengths[source.clamp(min=0)], first)
    starts = torch.repeat_interleave(cu[:-1] - first, lengths)
    return torch.arange(length, dtype=torch.long) - starts


def check_packed_positions(
    position_ids: torch.Tensor, cu_seq_lens: torch.Tensor, prefix_of: torch.Tensor | None = None
) -> None:
    """Raise DataError unless ``position_ids`` restart exactly at the ``cu_seq_lens`` boundaries (at 0, or after
    the segment's shared prompt).

    Why: transformers infers sequence boundaries from position ids; a mismatch would silently let tokens attend
    across sequences.
    """
    pos = position_ids.reshape(-1)
    expected = expected_position_ids(cu_seq_lens, pos.numel(), prefix_of)
    if not torch.equal(pos.cpu().to(torch.long), expected):
        bad = int((pos.cpu().to(torch.long) != expected).nonzero()[0].item())
        raise DataError(
            f"position_ids do not restart at the cu_seq_lens boundaries (first mismatch at position {bad}: "
            f"got {int(pos[bad])}, expected {int(expected[bad])})",
            field="position_ids",
        )


def packed_hidden_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    check: bool = True,
    prefix_of: torch.Tensor | None = None,
    sp_group=None,
) -> torch.Tensor:
    """Final hidden states ``[L, H]`` of a packed row (1-D ``input_ids``/``position_ids`` of length L).

    ``check=False`` skips the boundary check (a host sync) when the caller built the pack itself. ``prefix_of``
    (shared prompts, see ``rlpipe.data.packing``) needs the ``PACKED_SDPA`` attention. With an ``sp_group`` of
    more than one rank the row must already be padded to a multiple of its size (``pad_for_sp``), the backbone
    runs on this rank's slice only (``local_bounds``) and the result is that slice's ``[L / sp, H]``.
    """
    if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
        raise DataError(
            f"packed input_ids/position_ids must be 1-D of equal length, got {tuple(input_ids.shape)} and "
            f"{tuple(position_ids.shape)}",
            field="input_ids",
        )
    if check:
        check_packed_positions(position_ids, cu_seq_lens, prefix_of)
    backbone = model.get_decoder()
    varlen = {}
    packed_sdpa = getattr(model.config, "_attn_implementation", None) == PACKED_SDPA
    if prefix_of is not None and not packed_sdpa:
        raise DataError(
            f"shared-prompt packs need attn_implementation {PACKED_SDPA!r} (train.packed_attention with sdpa); this "
            f"model uses {getattr(model.config, '_attn_implementation', None)!r}: pack with share_prompts=False",
            field="prefix_of",
        )
    sp = group_size(sp_group)
    if sp > 1 and not packed_sdpa:
        raise DataError(
            f"train.sp_size={sp} needs attn_implementation {PACKED_SDPA!r} (model.attn_implementation=sdpa with "
            f"train.packed_attention=true); this model uses {getattr(model.config, '_attn_implementation', None)!r}",
            field="train.sp_size",
        )
    if packed_sdpa:  # per-sequence attention, no L x L mask
        max_len = int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max()) if cu_seq_lens.numel() > 1 else 0
        varlen = {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": max_len,
                  "max_length_k": max_len}  # fmt: skip
        if prefix_of is not None:
            varlen[PREFIX_OF_KWARG] = prefix_of
    if sp > 1:
        start, end = local_bounds(input_ids.numel(), dist.get_rank(sp_group), sp)
        input_ids, position_ids = input_ids[start:end], position_ids[start:end]
        varlen[SP_GROUP_KWARG] = sp_group
    out = backbone(
        input_ids=input_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        attention_mask=None,  # None + restarting position_ids => transformers builds the packed (block) mask
        use_cache=False,  # a cache disables packed-sequence detection
        **varlen,
    )
    return out.last_hidden_state[0]


def lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The ``[V, H]`` output projection (tied or not), so logits can be computed chunk by chunk."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise NotImplementedError("token_logprobs needs a bias-free linear LM head")
    return head.weight


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor | Pack,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
    shifted_labels: torch.Tensor | None = None,
    chunk_size: int = 1024,
    prefix_of: torch.Tensor | None = None,
    temperature: float = 1.0,
    sp_group=None,
) -> torch.Tensor:
    """Logprob of ``shifted_labels[t]`` at every position ``t`` (``[L]``, 0 where the label is -100), under
    ``softmax(logits / temperature)`` (RL scores at the sampling temperature; 1 is exactly the untempered value).

    Call either as ``token_logprobs(model, pack, chunk_size=...)`` with a ``rlpipe.data.packing.Pack`` or with the
    four tensors. Logits are never materialised for all tokens at once (``rlpipe.algos.logprobs.chunked_logprobs``).
    With an ``sp_group`` (``train.sp_size`` > 1) every rank of the group passes the same pack, scores its slice
    of the tokens and returns the full ``[L]`` (``rlpipe.models.sequence_parallel``).
    """
    if not isinstance(input_ids, torch.Tensor):
        pack = input_ids
        input_ids, position_ids = pack.input_ids, pack.position_ids
        cu_seq_lens, shifted_labels, prefix_of = pack.cu_seq_lens, pack.shifted_labels, pack.prefix_of
    if position_ids is None or cu_seq_lens is None or shifted_labels is None:
        raise TypeError("token_logprobs needs a Pack or input_ids, position_ids, cu_seq_lens and shifted_labels")
    # Imported here: rlpipe.algos is a sibling package and must stay importable without models.
    from rlpipe.algos.logprobs import chunked_logprobs

    sp = group_size(sp_group)
    if sp == 1:
        hidden = packed_hidden_states(model, input_ids, position_ids, cu_seq_lens, prefix_of=prefix_of)
        return chunked_logprobs(hidden, lm_head_weight(model), shifted_labels.to(hidden.device), chunk_size,
                                temperature)  # fmt: skip
    length = input_ids.numel()
    check_packed_positions(position_ids, cu_seq_lens, prefix_of)  # on the whole row, before it is split
    ids, pos, cu, labels, prefix_of = pad_for_sp(input_ids, position_ids, cu_seq_lens, shifted_labels, prefix_of, sp)
    hidden = packed_hidden_states(model, ids, pos, cu, check=False, prefix_of=prefix_of, sp_group=sp_group)
    start, end = local_bounds(ids.numel(), dist.get_rank(sp_group), sp)
    local = chunked_logprobs(hidden, lm_head_weight(model), labels[start:end].to(hidden.device), chunk_size,
                             temperature)  # fmt: skip
    return gather_tokens(local, sp_group)[:length]
