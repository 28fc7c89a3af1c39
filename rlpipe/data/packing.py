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

Prompt sharing (``share_prompts=True``): the ``n`` samples of a GRPO group repeat one prompt, and for short responses
the prompt is most of every sequence. Consecutive items with the same prompt (at least two tokens) are then laid out
as one *unit*: a shared segment holding ``prompt[:-1]`` (positions ``0..P-2``, no labels, ``seq_index`` =
``SHARED_PREFIX``), then one segment per sample holding ``prompt[-1] + response`` (positions ``P-1..``), whose
``prefix_of`` entry names the shared segment. Every label sits at the same position (and sees the same keys, through
``rlpipe.models.packed_attention``) as in the unshared layout, so logprobs, losses and gradients are the same; the
prompt is computed once per unit instead of once per sample. Units are packed first-fit-decreasing like sequences;
a unit longer than ``pack_max_length`` is split into several (each with its own copy of the prefix).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from rlpipe.errors import DataError

IGNORE_INDEX = -100
PADDING = -1  # seq_index of padding positions
SHARED_PREFIX = -2  # seq_index of a shared prompt segment (it belongs to several rows)


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
    position_ids: torch.Tensor  # int64 [L], restarts at 0 for every segment (a shared prompt's samples at P-1)
    cu_seq_lens: torch.Tensor  # int32 [num_segments + 1], segment boundaries incl. a trailing padding segment
    shifted_labels: torch.Tensor  # int64 [L], -100 on prompt, padding and the last token of each sequence
    advantages: torch.Tensor  # float32 [L], aligned to labels
    rollout_logprobs: torch.Tensor | None  # float32 [L], aligned to labels
    seq_index: torch.Tensor  # int64 [L], row of the source sequence per position, -1 on padding, -2 shared prompt
    prefix_of: torch.Tensor | None = None  # int64 [num_segments]: segment holding this one's shared prompt, or -1

    @property
    def length(self) -> int:
        """L, the pack length including padding."""
        return int(self.input_ids.numel())

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) positions: what the forward computes (a shared prompt counts once)."""
        return int((self.seq_index != PADDING).sum())

    @property
    def num_sequence_tokens(self) -> int:
        """Prompt + response tokens of the sequences in the pack, a shared prompt counted once per sequence: the
        work the pack stands for, the same for the shared and the unshared layout (throughput and token counters)."""
        return sum(n + prefix for n, prefix, owner in self._segments() if owner >= 0)

    def _segments(self) -> list[tuple[int, int, int]]:
        """(length, shared-prompt length or 0, owner) of every segment; owner is a row, PADDING or SHARED_PREFIX."""
        bounds = self.cu_seq_lens.tolist()
        lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
        owners = [int(self.seq_index[start]) if start < self.length else PADDING for start in bounds[:-1]]
        prefix = self.prefix_of.tolist() if self.prefix_of is not None else [-1] * len(lengths)
        return [(n, lengths[p] if p >= 0 else 0, o) for n, p, o in zip(lengths, prefix, owners, strict=True)]

    @property
    def num_label_tokens(self) -> int:
        """Positions that carry a label (response tokens): the loss denominator's share of this pack."""
        return int((self.shifted_labels != IGNORE_INDEX).sum())

    @property
    def num_sequences(self) -> int:
        """Real sequences in the pack (padding and shared-prompt segments are not counted)."""
        return len(self.sequence_lengths())

    def sequence_lengths(self) -> list[int]:
        """Length of every segment that belongs to one row (not padding, not a shared prompt), in pack order."""
        return [n for n, _, owner in self._segments() if owner >= 0]

    @property
    def attention_work(self) -> int:
        """Σ over real segments of queries x keys (a shared prompt's keys count for each segment that reads them)."""
        return sum(n * (n + prefix) for n, prefix, owner in self._segments() if owner != PADDING)

    @property
    def efficient_attn_ratio(self) -> float:
        """Σ seq_len² / L² (``attention_work`` / L²): attention work over the real sequences (block-diagonal, as
        varlen attention computes it) relative to one dense L×L attention over the whole row. Small means packing
        saves attention compute versus treating the row as one sequence; a dummy pack gives 0."""
        total = self.length**2
        return float(self.attention_work / total) if total else 0.0

    def to(self, device: torch.device | str) -> Pack:
        """A copy with every tensor moved to ``device``."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return Pack(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in moved.items()})


def efficient_attn_ratio(packs: Sequence[Pack]) -> float:
    """Batch-level ratio: Σ over packs of ``attention_work`` divided by Σ L² (the per-pack definition, pooled)."""
    num = sum(p.attention_work for p in packs)
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


@dataclass
class _Unit:
    """Items packed together: one item, or several samples of one prompt sharing its first P-1 tokens."""

    items: list[SequenceItem]
    shared: bool

    @property
    def length(self) -> int:
        if not self.shared:
            return self.items[0].length
        return len(self.items[0].prompt_ids) - 1 + sum(1 + len(it.response_ids) for it in self.items)


def _units(items: Sequence[SequenceItem], max_length: int, share_prompts: bool) -> list[_Unit]:
    """Group consecutive items with the same prompt (>= 2 tokens) into shared units of at most ``max_length``."""
    if not share_prompts:
        return [_Unit([it], False) for it in items]
    units: list[_Unit] = []
    group: list[SequenceItem] = []
    shared_length = 0  # length of `group` laid out as a shared unit

    for it in items:
        same = group and list(it.prompt_ids) == list(group[0].prompt_ids) and len(it.prompt_ids) > 1
        if group and not (same and shared_length + 1 + len(it.response_ids) <= max_length):
            units.append(_Unit(group, len(group) > 1))
            group = []
        if not group:
            shared_length = len(it.prompt_ids) - 1
        group.append(it)
        shared_length += 1 + len(it.response_ids)
    if group:
        units.append(_Unit(group, len(group) > 1))
    return units


def _build_pack(units: Sequence[_Unit], length: int, pad_token_id: int, with_logprobs: bool) -> Pack:
    """Lay out ``units`` back to back, then one padding segment up to ``length`` if room is left."""
    layout = _Layout(length, pad_token_id, with_logprobs)
    for unit in units:
        if unit.shared:
            prompt = list(unit.items[0].prompt_ids)
            prefix = layout.add_segment(prompt[:-1], 0, SHARED_PREFIX)
            for it in unit.items:
                layout.add_segment(prompt[-1:] + list(it.response_ids), len(prompt) - 1, it.row, it, 1, prefix)
        else:
            it = unit.items[0]
            layout.add_segment(list(it.prompt_ids) + list(it.response_ids), 0, it.row, it, len(it.prompt_ids))
    return layout.finish()


class _Layout:
    """Writes segments into the pack left to right (Python lists, one tensor per field at the end: the packer runs
    on the driver every iteration, and per-segment tensor slicing cost more than the packing itself)."""

    def __init__(self, length: int, pad_token_id: int, with_logprobs: bool):
        self.length, self.pad_token_id, self.with_logprobs = length, pad_token_id, with_logprobs
        self.input_ids: list[int] = []
        self.position_ids: list[int] = []
        self.labels: list[int] = []
        self.advantages: list[float] = []
        self.logprobs: list[float] = []
        self.seq_index: list[int] = []
        self.bounds, self.prefix_of = [0], []

    def add_segment(
        self, tokens: list[int], first_position: int, owner: int, item: SequenceItem | None = None,
        prompt_tokens: int = 0, prefix: int = -1,
    ) -> int:  # fmt: skip
        """Write one segment; ``item``'s response labels start at its ``prompt_tokens``-th token. Returns its index."""
        t = len(tokens)
        self.input_ids += tokens
        self.position_ids += range(first_position, first_position + t)
        self.seq_index += [owner] * t
        r = len(item.response_ids) if item is not None else 0
        lead = prompt_tokens - 1 if r else t  # response token j is scored at the position of the token before it
        tail = t - lead - r

        def aligned(values: Sequence, fill: float) -> list:  # per-response-token values at their label positions
            return [fill] * lead + list(values) + [fill] * tail

        self.labels += aligned(item.response_ids if r else [], IGNORE_INDEX)
        self.advantages += aligned([float(item.advantage)] * r if r else [], 0.0)
        if self.with_logprobs:
            self.logprobs += aligned((item.rollout_logprobs or []) if r else [], 0.0)
        self.bounds.append(self.bounds[-1] + t)
        self.prefix_of.append(prefix)
        return len(self.prefix_of) - 1

    def finish(self) -> Pack:
        extra = self.length - len(self.input_ids)
        if extra > 0:
            self.add_segment([self.pad_token_id] * extra, 0, PADDING)
        shared = any(p >= 0 for p in self.prefix_of)
        return Pack(
            input_ids=torch.tensor(self.input_ids, dtype=torch.long),
            position_ids=torch.tensor(self.position_ids, dtype=torch.long),
            cu_seq_lens=torch.tensor(self.bounds, dtype=torch.int32),
            shifted_labels=torch.tensor(self.labels, dtype=torch.long),
            advantages=torch.tensor(self.advantages, dtype=torch.float32),
            rollout_logprobs=torch.tensor(self.logprobs, dtype=torch.float32) if self.with_logprobs else None,
            seq_index=torch.tensor(self.seq_index, dtype=torch.long),
            prefix_of=torch.tensor(self.prefix_of, dtype=torch.long) if shared else None,
        )


def _first_fit_bins(units: Sequence[_Unit], max_length: int) -> list[list[_Unit]]:
    """First-fit-decreasing: longest unit first, into the first bin with room (fewest bins, last ones emptier)."""
    bins: list[list[_Unit]] = []
    room: list[int] = []
    for unit in sorted(units, key=lambda u: -u.length):  # stable: ties keep input order
        for b, free in enumerate(room):
            if unit.length <= free:
                bins[b].append(unit)
                room[b] -= unit.length
                break
        else:
            bins.append([unit])
            room.append(max_length - unit.length)
    return bins


def _balanced_bins(units: Sequence[_Unit], max_length: int, dp_size: int) -> list[list[_Unit]]:
    """Longest unit first into the least-loaded bin with room, over the fewest bins that could hold the tokens
    (a multiple of ``dp_size``; ``dp_size`` more are opened when nothing fits): every bin ends up with about the same
    number of tokens, so every rank's micro-batch costs about the same."""
    total = sum(u.length for u in units)
    count = dp_size * math.ceil(total / (dp_size * max_length))  # no units, no bins
    bins: list[list[_Unit]] = [[] for _ in range(count)]
    load = [0] * count
    for unit in sorted(units, key=lambda u: -u.length):  # stable: ties keep input order
        fits = [b for b in range(len(bins)) if load[b] + unit.length <= max_length]
        if not fits:
            bins += [[] for _ in range(dp_size)]
            load += [0] * dp_size
            fits = list(range(len(bins) - dp_size, len(bins)))
        target = min(fits, key=lambda b: (load[b], b))
        bins[target].append(unit)
        load[target] += unit.length
    return bins


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
    share_prompts: bool = False,
    balance: bool = False,
) -> list[Pack]:
    """Greedy first-fit-decreasing packing; see the module docstring.

    With ``pad_to_max_length=False`` every pack is exactly as long as its sequences (dummy packs are one token).
    With ``share_prompts=True`` consecutive samples of one prompt share its computation (module docstring); the
    model must then score packs with ``rlpipe.models.packed_attention`` (which reads ``Pack.prefix_of``).
    With ``balance=True`` the tokens are spread evenly over the fewest packs (a multiple of ``dp_size``) instead of
    filling each pack in turn (``_balanced_bins``): data-parallel ranks meet at every collective, so the rank with
    the fullest pack sets the pace, and first-fit leaves the last pack nearly empty.
    The number of packs is a multiple of ``dp_size`` (no items give no packs).
    A sequence longer than ``pack_max_length`` raises DataError naming its row.
    """
    if pack_max_length <= 0:
        raise DataError(f"pack_max_length must be positive, got {pack_max_length}", field="pack_max_length")
    if dp_size <= 0:
        raise DataError(f"dp_size must be positive, got {dp_size}", field="dp_size")
    with_lp = _validate(items, pack_max_length)
    units = _units(items, pack_max_length, share_prompts)
    bins = _balanced_bins(units, pack_max_length, dp_size) if balance else _first_fit_bins(units, pack_max_length)
    room = [pack_max_length - sum(u.length for u in b) for b in bins]
    packs = [
        _build_pack(b, pack_max_length if pad_to_max_length else max(pack_max_length - free, 1), pad_token_id, with_lp)
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
    packs = [_build_pack([_Unit([it], False)], longest, pad_token_id, with_lp) for it in items]
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
    prefix_of = pack.prefix_of
    if int(pack.seq_index[-1]) == PADDING:  # already ends in a padding segment: widen it
        bounds[-1] = length
        positions = torch.cat([pack.position_ids, pack.position_ids[-1] + 1 + torch.arange(extra)])
    else:
        bounds.append(length)
        positions = torch.cat([pack.position_ids, torch.arange(extra)])
        if prefix_of is not None:
            prefix_of = torch.cat([prefix_of, prefix_of.new_full((1,), -1)])
    return Pack(
        input_ids=grow(pack.input_ids, pad_token_id),
        position_ids=positions,
        cu_seq_lens=torch.tensor(bounds, dtype=torch.int32),
        shifted_labels=grow(pack.shifted_labels, IGNORE_INDEX),
        advantages=grow(pack.advantages, 0.0),
        rollout_logprobs=None if pack.rollout_logprobs is None else grow(pack.rollout_logprobs, 0.0),
        seq_index=grow(pack.seq_index, PADDING),
        prefix_of=prefix_of,
    )


def dp_shards(items: Sequence, dp_size: int) -> list[list]:
    """Items (packs, or values aligned with them) split round-robin over ``dp_size`` ranks: rank r gets items r,
    r + dp, ... Round-robin spreads the fuller first-fit-decreasing packs over ranks; the counts are equal because
    ``pack_sequences`` pads the number of packs to a multiple of dp."""
    return [list(items[rank::dp_size]) for rank in range(dp_size)]


def mesh_shards(items: Sequence, dp_size: int, sp_size: int = 1) -> list[list]:
    """Per rank of a (dp, sp) mesh (rank = dp_rank * sp_size + sp_rank): the ``dp_shards`` of its dp rank, so the
    ``sp_size`` ranks of an sp group get the same items (they split each pack's tokens, not the packs)."""
    return [shard for shard in dp_shards(items, dp_size) for _ in range(sp_size)]


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
