"""How a run turns a rollout batch into packs: `optimizer_steps` mini-batches, each packed and padded to a multiple
of the data-parallel size.

The split is a property of the data, not of the world size, so 1 and N ranks take the same optimizer steps. Packing
depends only on sequence lengths, so per-row values (old/ref logprobs carried by a batch) land in the same layout
as the sequences they belong to (`aligned`).
"""

from __future__ import annotations

import dataclasses

import pandas as pd
import torch

from rlpipe.config import PipelineConfig
from rlpipe.data.packing import Pack, SequenceItem, pack_sequences
from rlpipe.models.packed_attention import PACKED_SDPA, scoring_attention


class Batching:
    """The packing policy of one run (`train.pack_max_length`, dp size, shared prompts)."""

    def __init__(self, cfg: PipelineConfig, pad_token_id: int):
        self.cfg, self.pad_token_id = cfg, pad_token_id

    @property
    def share_prompts(self) -> bool:
        """Shared-prompt packs need the per-sequence packed attention (the only backend that reads `prefix_of`)."""
        t = self.cfg.train
        return (
            t.share_prompts and scoring_attention(self.cfg.model.attn_implementation, t.packed_attention) == PACKED_SDPA
        )

    def pack(self, items: list[SequenceItem]) -> list[Pack]:
        """Balanced, deterministic packs whose number is a multiple of dp."""
        return pack_sequences(
            items,
            self.cfg.train.pack_max_length,
            self.pad_token_id,
            self.cfg.dp_size,
            pad_to_max_length=False,
            share_prompts=self.share_prompts,
            balance=True,
        )

    def minibatches(self, items: list[SequenceItem]) -> list[list[Pack]]:
        """`optimizer_steps` contiguous mini-batches of the items (fewer if there are fewer items), each packed."""
        k = min(self.cfg.train.optimizer_steps, len(items))
        bounds = [round(i * len(items) / k) for i in range(k + 1)]
        return [self.pack(items[bounds[i] : bounds[i + 1]]) for i in range(k)]

    def aligned(self, batch: pd.DataFrame, column: str, items: list[SequenceItem]) -> list[list[torch.Tensor]] | None:
        """A response-aligned batch column as label-aligned tensors per mini-batch and pack, in `minibatches`' layout;
        None when the batch lacks the column."""
        if column not in batch.columns:
            return None
        values = batch[column]
        shadow = [dataclasses.replace(it, rollout_logprobs=[float(x) for x in values.iloc[it.row]]) for it in items]
        return [[p.rollout_logprobs for p in mb] for mb in self.minibatches(shadow)]
