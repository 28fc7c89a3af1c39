"""Resumable, deterministic batch sampler over a dataset's rows (RL prompts and SFT examples alike).

The index stream is a sequence of epochs; epoch ``e`` visits ``numpy.random.default_rng([seed, e]).permutation(N)``
(identity order when ``shuffle=False``). Seeding with the pair ``[seed, epoch]`` (a SeedSequence) rather than
``seed + epoch`` keeps (seed=0, epoch=1) and (seed=1, epoch=0) different.

- ``drop_last=True``: each epoch yields ``N // batch_size`` full batches; its last ``N % batch_size`` examples are
  skipped and the next epoch starts with a fresh permutation.
- ``drop_last=False``: the epochs are concatenated; a batch that reaches the end of an epoch is completed from the
  start of the next one, so every example is visited once per epoch and every batch is full size.

``batch_size`` is the global number of items per step. With ``dp_size > 1`` the global batch is cut into
``dp_size`` contiguous slices and rank ``r`` gets slice ``r``. Every rank draws the same global stream, so the
slices are disjoint within a step and together cover the global batch.

The state is plain JSON (``state_dict``); a sampler built with the same arguments and loaded with that state
continues exactly where the saved one stopped. The same class serves the SFT dataloader (with its own seed).
``SamplerState`` is the one definition of that state: ``train_state.json`` and the Flyte ``Checkpoint`` type hold it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlpipe.errors import ConfigError, DataError


@dataclass
class SamplerState:
    """Position of an ``EpochSampler`` in its index stream (plain ints, JSON as a dict)."""

    epoch: int = 0
    consumed_in_epoch: int = 0
    total_consumed: int = 0
    seed: int = 0
    num_examples: int = 0


STATE_KEYS = ("epoch", "consumed_in_epoch", "total_consumed", "seed")  # required; num_examples is optional


class EpochSampler:
    """Deterministic index sampler with JSON state; see the module docstring for the stream definition."""

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        for name, value in (("num_examples", num_examples), ("batch_size", batch_size), ("dp_size", dp_size)):
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not _is_int(seed) or seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
        if not _is_int(dp_rank) or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank must be in [0, {dp_size}), got {dp_rank!r}")
        if batch_size % dp_size:
            raise ConfigError(f"batch_size {batch_size} is not divisible by dp_size {dp_size}")
        if drop_last and batch_size > num_examples:
            raise ConfigError(
                f"batch_size {batch_size} exceeds the {num_examples} examples with drop_last=True: no batch would be yielded"
            )
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.epoch = 0
        self.consumed_in_epoch = 0
        self.total_consumed = 0
        self._perm_epoch = -1
        self._perm: np.ndarray = np.empty(0, dtype=np.int64)

    @property
    def local_batch_size(self) -> int:
        """Items this rank gets per step."""
        return self.batch_size // self.dp_size

    def epoch_permutation(self, epoch: int) -> list[int]:
        """The visiting order of ``epoch`` (cached for the current one)."""
        return [int(i) for i in self._permutation(epoch)]

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            else:
                self._perm = np.arange(self.num_examples)
            self._perm_epoch = epoch
        return self._perm

    def _roll_epoch_if_needed(self) -> None:
        """Move to the next epoch when the current one cannot supply more (what drop_last means)."""
        remaining = self.num_examples - self.consumed_in_epoch
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self.consumed_in_epoch = 0

    def next_global_batch(self) -> list[int]:
        """The next global batch of dataset indices (all ranks' shares, in rank order)."""
        out: list[int] = []
        while len(out) < self.batch_size:
            self._roll_epoch_if_needed()
            take = min(self.batch_size - len(out), self.num_examples - self.consumed_in_epoch)
            perm = self._permutation(self.epoch)
            out.extend(int(i) for i in perm[self.consumed_in_epoch : self.consumed_in_epoch + take])
            self.consumed_in_epoch += take
        self.total_consumed += self.batch_size
        self._roll_epoch_if_needed()
        return out

    def next_batch(self) -> list[int]:
        """This rank's share of the next global batch: the ``dp_rank``-th contiguous slice."""
        batch = self.next_global_batch()
        k = self.local_batch_size
        return batch[self.dp_rank * k : (self.dp_rank + 1) * k]

    def state(self) -> SamplerState:
        """The position of the stream; ``num_examples`` is kept to catch a changed dataset."""
        return SamplerState(self.epoch, self.consumed_in_epoch, self.total_consumed, self.seed, self.num_examples)

    def state_dict(self) -> dict[str, Any]:
        """``state()`` as plain JSON (ints only)."""
        return dataclasses.asdict(self.state())

    def load_state_dict(self, state: Any) -> None:
        """Restore a position saved by ``state_dict``; junk (missing keys, wrong types, out of range) is a DataError.

        The saved seed replaces the constructor's (the state defines the stream). A saved ``num_examples`` that
        differs from this sampler's means the dataset changed: the permutation would differ, so it is an error.
        """
        if isinstance(state, SamplerState):
            state = dataclasses.asdict(state)
        if not isinstance(state, dict):
            raise DataError(f"sampler state must be a dict, got {type(state).__name__}", field="sampler_state")
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise DataError(f"sampler state lacks keys {missing}", field=missing[0])
        unknown = sorted(set(state) - set(STATE_KEYS) - {"num_examples"})
        if unknown:
            raise DataError(f"sampler state has unknown keys {unknown}", field=unknown[0])
        for key, value in state.items():
            if not _is_int(value) or value < 0:
                raise DataError(f"expected a non-negative integer, got {value!r}", field=key)
        if "num_examples" in state and state["num_examples"] != self.num_examples:
            raise DataError(
                f"state was saved for {state['num_examples']} examples, this dataset has {self.num_examples}",
                field="num_examples",
            )
        if state["consumed_in_epoch"] >= self.num_examples:
            raise DataError(
                f"consumed_in_epoch {state['consumed_in_epoch']} is not below num_examples {self.num_examples}",
                field="consumed_in_epoch",
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.consumed_in_epoch = int(state["consumed_in_epoch"])
        self.total_consumed = int(state["total_consumed"])
        self._perm_epoch = -1


def _is_int(value: Any) -> bool:
    """True for ints (and numpy ints) but not bools, which JSON junk often carries."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)
