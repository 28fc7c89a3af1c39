"""Pack variable-length sequences into fixed-budget 1-D rows (varlen attention via ``cu_seq_lens``).

Token layout (docs/ARCHITECTURE.md): a sequence is ``prompt_ids (P) + response_ids (R)``; position ``t`` predicts
token ``t+1``, so response token ``j`` is the label at position ``P-1+j``. Advantages and rollout logprobs live at the
same positions as their labels; every other position holds ``-100`` (labels) or ``0`` (values).

Packing is greedy first-fit-decreasing: sequences are sorted by length, longest first (a stable sort, so ties keep
input order), and each goes into the first pack with room. For a fixed input order the result is deterministic.
Inside a pack, sequences keep their placement order. Packs are padded to ``pack_max_length`` by default (static
shapes); the padding is its own segment in ``cu_seq_lens`` so no real token attends to it. Dummy packs (all padding,
labels all ``-100``) make the pack count a multiple of ``dp_size`` so every data-parallel rank runs the same number of
micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from rlpipe.errors import DataError

IGNORE_INDEX = -100


@dataclass
class SequenceItem:
    """One sequence to train on (an RL sample, or an SFT pair with advantage 1.0 and no rollout logprobs)."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float = 0.0
    rollout_logprobs: list[float] | None = None  # len == len(response_ids)
    row: int = 0  # index of the row in the RolloutBatch

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class Pack:
    """A packed row; all tensors are 1-D of length L (L <= pack_max_length) except ``cu_seq_lens``."""

    input_ids: torch.Tensor  # int64 [L]
    position_ids: torch.Tensor  # int64 [L], restarts at 0 for every segment
    cu_seq_lens: torch.Tensor  # int32 [num_segments + 1], segment boundaries incl. a trailing padding segment
    shifted_labels: torch.Tensor  # int64 [L], -100 on prompt, padding and the last token of each sequence
    advantages: torch.Tensor  # float32 [L], aligned to labels
    rollout_logprobs: torch.Tensor | None  # float32 [L], aligned to labels
    seq_index: torch.Tensor  # int64 [L], row of the source sequence per position, -1 on padding

    @property
    def length(self) -> int:
        """L, the pack length including padding."""
        return int(self.input_ids.numel())

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int((self.seq_index >= 0).sum())

    @property
    def num_label_tokens(self) -> int:
        """Positions that carry a label (response tokens): the loss denominator's share of this pack."""
        return int((self.shifted_labels != IGNORE_INDEX).sum())

    @property
    def num_sequences(self) -> int:
        """Real sequences in the pack (the padding segment is not counted)."""
        return len(self.sequence_lengths())

    def sequence_lengths(self) -> list[int]:
        """Length of every real segment, in pack order."""
        bounds = self.cu_seq_lens.tolist()
        return [
            end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True) if int(self.seq_index[start]) >= 0
        ]

    @property
    def efficient_attn_ratio(self) -> float:
        """Σ seq_len² / L²: causal attention work over the real sequences (block-diagonal, as varlen attention
        computes it) relative to one dense L×L attention over the whole row. Small means packing saves attention
        compute versus treating the row as one sequence; a dummy pack gives 0."""
        total = self.length**2
        return float(sum(n * n for n in self.sequence_lengths()) / total) if total else 0.0

    def to(self, device: torch.device | str) -> Pack:
        """A copy with every tensor moved to ``device``."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return Pack(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in moved.items()})


def efficient_attn_ratio(packs: Sequence[Pack]) -> float:
    """Batch-level ratio: Σ over packs of Σ seq_len² divided by Σ L² (the per-pack definition, pooled)."""
    num = sum(sum(n * n for n in p.sequence_lengths()) for p in packs)
    den = sum(p.length**2 for p in packs)
    return float(num / den) if den else 0.0


def _validate(items: Sequence[SequenceItem], max_length: int | None) -> bool:
    """Check rows, lengths and logprob presence; return whether packs carry rollout logprobs."""
    seen: set[int] = set()
    with_lp = [it.rollout_logprobs is not None for it in items]
    if any(with_lp) and not all(with_lp):
        missing = items[with_lp.index(False)]
        raise DataError(
            "rollout_logprobs given for some sequences but not this one", row=missing.row, field="rollout_logprobs"
        )
    for it in items:
        if it.row < 0:
            raise DataError(f"row must be >= 0, got {it.row}", row=it.row, field="row")
        if it.row in seen:
            raise DataError("row appears twice in one packing call", row=it.row, field="row")
        seen.add(it.row)
        if not it.prompt_ids:
            raise DataError(
                "empty prompt: the first response token would have no position to be scored at",
                row=it.row,
                field="prompt_ids",
            )
        if it.rollout_logprobs is not None and len(it.rollout_logprobs) != len(it.response_ids):
            raise DataError(
                f"{len(it.rollout_logprobs)} rollout logprobs for {len(it.response_ids)} response tokens",
                row=it.row,
                field="rollout_logprobs",
            )
        if max_length is not None and it.length > max_length:
            raise DataError(
                f"sequence of {it.length} tokens (prompt {len(it.prompt_ids)} + response {len(it.response_ids)}) "
                f"exceeds pack_max_length={max_length}",
                row=it.row,
                field="response_ids",
            )
    return bool(items) and all(with_lp)


def _build_pack(items: Sequence[SequenceItem], length: int, pad_token_id: int, with_logprobs: bool) -> Pack:
    """Lay out ``items`` back to back, then one padding segment up to ``length`` if room is left."""
    input_ids = torch.full((length,), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(length, dtype=torch.long)
    labels = torch.full((length,), IGNORE_INDEX, dtype=torch.long)
    advantages = torch.zeros(length, dtype=torch.float32)
    logprobs = torch.zeros(length, dtype=torch.float32) if with_logprobs else None
    seq_index = torch.full((length,), -1, dtype=torch.long)
    bounds = [0]
    offset = 0
    for it in items:
        p, r = len(it.prompt_ids), len(it.response_ids)
        t = p + r
        input_ids[offset : offset + t] = torch.tensor(list(it.prompt_ids) + list(it.response_ids), dtype=torch.long)
        position_ids[offset : offset + t] = torch.arange(t)
        seq_index[offset : offset + t] = it.row
        if r:
            lo = offset + p - 1  # response token j is scored at position P-1+j
            labels[lo : lo + r] = torch.tensor(list(it.response_ids), dtype=torch.long)
            advantages[lo : lo + r] = float(it.advantage)
            if logprobs is not None:
                logprobs[lo : lo + r] = torch.tensor(list(it.rollout_logprobs or []), dtype=torch.float32)
        offset += t
        bounds.append(offset)
    if offset < length:
        position_ids[offset:] = torch.arange(length - offset)
        bounds.append(length)
    return Pack(
        input_ids=input_ids,
        position_ids=position_ids,
        cu_seq_lens=torch.tensor(bounds, dtype=torch.int32),
        shifted_labels=labels,
        advantages=advantages,
        rollout_logprobs=logprobs,
        seq_index=seq_index,
    )


def _pad_count(packs: list[Pack], dp_size: int, length: int, pad_token_id: int, with_logprobs: bool) -> list[Pack]:
    if dp_size <= 0:
        raise DataError(f"dp_size must be positive, got {dp_size}", field="dp_size")
    while len(packs) % dp_size:
        packs.append(_build_pack([], length, pad_token_id, with_logprobs))
    return packs


def pack_sequences(
    items: Sequence[SequenceItem],
    pack_max_length: int,
    pad_token_id: int,
    dp_size: int = 1,
    *,
    pad_to_max_length: bool = True,
) -> list[Pack]:
    """Greedy first-fit-decreasing packing; see the module docstring.

    With ``pad_to_max_length=False`` every pack is exactly as long as its sequences (dummy packs are one token).
    The number of packs is a multiple of ``dp_size`` (no items give no packs).
    A sequence longer than ``pack_max_length`` raises DataError naming its row.
    """
    if pack_max_length <= 0:
        raise DataError(f"pack_max_length must be positive, got {pack_max_length}", field="pack_max_length")
    if dp_size <= 0:
        raise DataError(f"dp_size must be positive, got {dp_size}", field="dp_size")
    with_lp = _validate(items, pack_max_length)
    order = sorted(range(len(items)), key=lambda i: -items[i].length)  # stable: ties keep input order
    bins: list[list[SequenceItem]] = []
    room: list[int] = []
    for i in order:
        n = items[i].length
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(items[i])
                room[b] -= n
                break
        else:
            bins.append([items[i]])
            room.append(pack_max_length - n)
    packs = [
        _build_pack(b, pack_max_length if pad_to_max_length else pack_max_length - free, pad_token_id, with_lp)
        for b, free in zip(bins, room, strict=True)
    ]
    return _pad_count(packs, dp_size, pack_max_length if pad_to_max_length else 1, pad_token_id, with_lp)


def pad_sequences(
    items: Sequence[SequenceItem], pad_token_id: int, dp_size: int = 1, *, max_length: int | None = None
) -> list[Pack]:
    """Padded baseline for benchmarks: one sequence per Pack, each padded to the longest sequence of ``items``.

    Same fields and label alignment as ``pack_sequences``, so the same training code runs on both; order is the
    input order. ``max_length`` (optional) rejects too-long sequences like ``pack_max_length`` does.
    """
    with_lp = _validate(items, max_length)
    longest = max((it.length for it in items), default=1)
    packs = [_build_pack([it], longest, pad_token_id, with_lp) for it in items]
    return _pad_count(packs, dp_size, longest, pad_token_id, with_lp)


def pad_pack_to_length(pack: Pack, length: int, pad_token_id: int) -> Pack:
    """Extend a pack with padding (its own segment) to ``length``, e.g. to stack packs of unequal length."""
    n = pack.length
    if length < n:
        raise DataError(f"cannot pad a pack of length {n} down to {length}", field="length")
    if length == n:
        return pack
    extra = length - n

    def grow(t: torch.Tensor, fill: float | int) -> torch.Tensor:
        return torch.cat([t, torch.full((extra,), fill, dtype=t.dtype)])

    bounds = pack.cu_seq_lens.tolist()
    if int(pack.seq_index[-1]) < 0:  # already ends in a padding segment: widen it
        bounds[-1] = length
        positions = torch.cat([pack.position_ids, pack.position_ids[-1] + 1 + torch.arange(extra)])
    else:
        bounds.append(length)
        positions = torch.cat([pack.position_ids, torch.arange(extra)])
    return Pack(
        input_ids=grow(pack.input_ids, pad_token_id),
        position_ids=positions,
        cu_seq_lens=torch.tensor(bounds, dtype=torch.int32),
        shifted_labels=grow(pack.shifted_labels, IGNORE_INDEX),
        advantages=grow(pack.advantages, 0.0),
        rollout_logprobs=None if pack.rollout_logprobs is None else grow(pack.rollout_logprobs, 0.0),
        seq_index=grow(pack.seq_index, -1),
    )


def stack_packs(packs: Sequence[Pack]) -> dict[str, torch.Tensor]:
    """Stack equal-length packs into ``[N, L]`` tensors (``cu_seq_lens`` is per-pack and not stacked)."""
    if not packs:
        raise DataError("no packs to stack", field="packs")
    lengths = {p.length for p in packs}
    if len(lengths) != 1:
        raise DataError(f"packs have different lengths {sorted(lengths)}; pad them first", field="packs")
    names = ["input_ids", "position_ids", "shifted_labels", "advantages", "seq_index"]
    out = {name: torch.stack([getattr(p, name) for p in packs]) for name in names}
    if all(p.rollout_logprobs is not None for p in packs):
        out["rollout_logprobs"] = torch.stack([p.rollout_logprobs for p in packs])  # type: ignore[misc]
    return out


def shard_packs(packs: Sequence[Pack], dp_rank: int, dp_size: int) -> list[Pack]:
    """Rank ``dp_rank``'s packs: every ``dp_size``-th starting at ``dp_rank`` (round-robin spreads the fuller
    first-fit-decreasing packs over ranks; counts are equal because ``pack_sequences`` pads to a multiple)."""
    if dp_size <= 0 or not 0 <= dp_rank < dp_size:
        raise DataError(f"bad dp_rank {dp_rank} / dp_size {dp_size}", field="dp_rank")
    if len(packs) % dp_size:
        raise DataError(f"{len(packs)} packs do not split evenly over {dp_size} ranks", field="packs")
    return list(packs[dp_rank::dp_size])


def scatter_to_rows(packs: Sequence[Pack], values: Sequence[torch.Tensor], num_rows: int) -> list[list[float]]:
    """Per-pack label-aligned ``[L]`` values -> per-row response-aligned lists (inverse of the packing layout).

    ``result[row]`` holds the values at that row's label positions in order, i.e. one value per response token.
    Rows that appear in no pack get ``[]``; a row outside ``[0, num_rows)`` or split over two packs is a DataError.
    """
    if len(values) != len(packs):
        raise DataError(f"{len(values)} value tensors for {len(packs)} packs", field="values")
    out: list[list[float]] = [[] for _ in range(num_rows)]
    filled: set[int] = set()
    for k, (pack, vals) in enumerate(zip(packs, values, strict=True)):
        if vals.shape != pack.shifted_labels.shape:
            raise DataError(
                f"values of pack {k} have shape {tuple(vals.shape)}, expected {tuple(pack.shifted_labels.shape)}",
                field="values",
            )
        mask = pack.shifted_labels != IGNORE_INDEX
        rows = pack.seq_index[mask].cpu()
        picked = vals.detach()[mask].float().cpu()
        if rows.numel() == 0:
            continue
        uniq, counts = torch.unique_consecutive(rows, return_counts=True)
        for row, chunk in zip(uniq.tolist(), torch.split(picked, counts.tolist()), strict=True):
            if not 0 <= row < num_rows:
                raise DataError(f"row {row} is outside [0, {num_rows})", row=row, field="seq_index")
            if row in filled:
                raise DataError("row appears in more than one segment", row=row, field="seq_index")
            filled.add(row)
            out[row] = chunk.tolist()
    return out
