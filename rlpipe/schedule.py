"""When things happen in a run. The synchronous loop, the async loop, the granular workflow and `rlpipe run` all ask
this one object, so "is SFT due after iteration 7?" has one answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlpipe.config import PipelineConfig


class Schedule:
    """The timetable of a run, read from its config (iterations are 1-based)."""

    def __init__(self, cfg: PipelineConfig):
        self.iterations = cfg.iterations
        self.sft_every = cfg.sft.rollout_steps_per_sft if cfg.sft.enabled else 0
        self.eval_every = cfg.eval_every
        self.checkpoint_every = cfg.checkpoint.every
        self.segment_size = cfg.segment_size
        self.optimizer_steps = cfg.train.optimizer_steps

    def sft_due(self, iteration: int) -> bool:
        """One SFT step after every `sft.rollout_steps_per_sft`-th RL iteration, as the seed does."""
        return bool(self.sft_every) and iteration % self.sft_every == 0

    def eval_due(self, iteration: int) -> bool:
        """Held-out evaluation after every `eval_every`-th iteration."""
        return bool(self.eval_every) and iteration % self.eval_every == 0

    def checkpoint_due(self, iteration: int) -> bool:
        """A checkpoint inside a segment every `checkpoint.every` iterations (segments also save at their end)."""
        return bool(self.checkpoint_every) and iteration % self.checkpoint_every == 0

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run (RL + SFT): the length of the LR schedule."""
        sft = self.iterations // self.sft_every if self.sft_every else 0
        return self.iterations * self.optimizer_steps + sft

    def segments(self, done: int) -> list[tuple[int, int]]:
        """(first iteration, iterations) of each segment still to run after `done` iterations."""
        out, first = [], done + 1
        while first <= self.iterations:
            k = min(self.segment_size, self.iterations - first + 1)
            out.append((first, k))
            first += k
        return out
