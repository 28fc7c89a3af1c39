"""Per-sequence reductions over packed token tensors.

Packed micro-batches hold several sequences in one 1-D tensor; ``seq_ids`` gives the sequence of every token
(-1 on padding). Sequence-level quantities (GSPO ratios, sequence IS weights, per-sequence means) are segment sums
over those ids. A sequence is "present" when it has at least one token in ``mask``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Segments:
    """Dense sequence indexing of the masked tokens of a tensor.

    ``valid`` is the flattened mask of tokens that count (in ``mask`` and ``seq_ids >= 0``); ``index[j]`` is the
    dense sequence number (``0 .. num_seqs-1``) of the ``j``-th valid token, in flattened order.
    """

    valid: torch.Tensor  # bool [numel]
    index: torch.Tensor  # int64 [num_valid]
    num_seqs: int

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence sum of ``values`` (same shape as the mask) over valid tokens -> ``[num_seqs]``."""
        flat = values.reshape(-1)[self.valid]
        return torch.zeros(self.num_seqs, dtype=flat.dtype, device=flat.device).index_add(0, self.index, flat)

    def count(self) -> torch.Tensor:
        """Valid tokens per sequence -> ``[num_seqs]`` (float32, every entry >= 1)."""
        ones = torch.ones(self.index.numel(), device=self.index.device)
        return torch.zeros(self.num_seqs, device=self.index.device).index_add(0, self.index, ones)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence mean of ``values`` over valid tokens -> ``[num_seqs]``."""
        return self.sum(values) / self.count().to(values.dtype)

    def any(self, flags: torch.Tensor) -> torch.Tensor:
        """Per-sequence: does any valid token have ``flags`` set -> bool ``[num_seqs]``."""
        return self.sum(flags.to(torch.float32)) > 0

    def broadcast(self, per_seq: torch.Tensor, shape: torch.Size, fill: float = 0.0) -> torch.Tensor:
        """Scatter a ``[num_seqs]`` value back to every valid token; ``fill`` elsewhere -> ``shape``."""
        out = torch.full((self.valid.numel(),), fill, dtype=per_seq.dtype, device=per_seq.device)
        out = out.masked_scatter(self.valid, per_seq[self.index])
        return out.reshape(shape)


def segments(mask: torch.Tensor, seq_ids: torch.Tensor | None = None) -> Segments:
    """Index the sequences of ``mask``'s tokens.

    Without ``seq_ids``, a 2-D (or higher) tensor has one sequence per row (dim 0) and a 1-D tensor is one sequence.
    """
    mask = mask.bool()
    if seq_ids is None:
        if mask.dim() >= 2:
            rows = torch.arange(mask.shape[0], device=mask.device)
            seq_ids = rows.reshape(-1, *([1] * (mask.dim() - 1))).expand(mask.shape)
        else:
            seq_ids = torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
    if seq_ids.shape != mask.shape:
        raise ValueError(f"seq_ids shape {tuple(seq_ids.shape)} != mask shape {tuple(mask.shape)}")
    ids = seq_ids.reshape(-1).to(mask.device)
    valid = mask.reshape(-1) & (ids >= 0)
    uniq, inverse = torch.unique(ids[valid], return_inverse=True)
    return Segments(valid=valid, index=inverse.reshape(-1), num_seqs=int(uniq.numel()))
