"""Reducible metric accumulators shared by the policy losses, rollout IS and mismatch metrics.

A mean over tokens (or sequences) of several ranks and micro-batches is only exact when the numerators and the
counts are summed separately; a min/max is exact when reduced with min/max. ``MetricSums`` keeps exactly those
accumulators (as float64 tensors, no host sync until ``finalize``):

- ``sums[name] / counts[name]``: mean metrics,
- ``mins[name]`` / ``maxs[name]``: extremes (``+inf`` / ``-inf`` while empty),
- ``derived[name] = (op, mean_key, sq_mean_key)``: ``"std"`` (unbiased, from E[x] and E[x^2]), ``"ess"``
  (normalised effective sample size E[w]^2 / E[w^2] = (sum w)^2 / (N sum w^2); 0 when every weight is 0: no
  effective data, e.g. every sequence vetoed) or ``"total"`` (the numerator of ``mean_key``, i.e. mean x count:
  a global count such as vetoed sequences; ``sq_mean_key`` is unused).

Names starting with ``_`` are helpers (e.g. E[x^2]) and are left out of ``finalize()``. ``defaults`` give the value
of a metric that saw no data (e.g. a ratio of 1.0 on an empty micro-batch).

Cross-rank use: every rank builds the same keys (the functions here always emit all keys, even on empty input), then
``reduce(sum_op, min_op, max_op)`` with all-reduce wrappers, then ``finalize()``. A ``MetricSums`` is also a
read-only ``Mapping`` of its finalised values, so code that wants a plain ``dict[str, float]`` can use it as one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

_F64 = torch.float64
ReduceOp = Callable[[torch.Tensor], torch.Tensor | None]


def _scalar(value: torch.Tensor | float, device=None) -> torch.Tensor:
    t = torch.as_tensor(value).detach()
    return t.to(dtype=_F64, device=device if device is not None else t.device).reshape(())


@dataclass(eq=False)
class MetricSums(Mapping):
    """Sum/count/min/max accumulators; ``merge`` combines micro-batches, ``finalize`` turns them into floats."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, torch.Tensor] = field(default_factory=dict)
    mins: dict[str, torch.Tensor] = field(default_factory=dict)
    maxs: dict[str, torch.Tensor] = field(default_factory=dict)
    derived: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    defaults: dict[str, float] = field(default_factory=dict)
    _cache: dict[str, float] | None = field(default=None, init=False, repr=False)

    # -- building -------------------------------------------------------------------------------------------------
    def add_mean(self, name: str, total: torch.Tensor | float, count: torch.Tensor | float) -> MetricSums:
        """Accumulate ``total`` into the numerator and ``count`` into the denominator of mean metric ``name``."""
        total = _scalar(total)
        count = _scalar(count, device=total.device)  # a python int count must live with its sum (CUDA)
        self.sums[name] = self.sums[name] + total.to(self.sums[name].device) if name in self.sums else total
        self.counts[name] = self.counts[name] + count.to(self.counts[name].device) if name in self.counts else count
        self._cache = None
        return self

    def add_min(self, name: str, values: torch.Tensor) -> MetricSums:
        """Fold the minimum of ``values`` (may be empty) into ``name``."""
        v = values.detach().to(_F64).reshape(-1)
        m = v.min() if v.numel() else torch.tensor(math.inf, dtype=_F64, device=v.device)
        self.mins[name] = torch.minimum(self.mins[name], m) if name in self.mins else m
        self._cache = None
        return self

    def add_max(self, name: str, values: torch.Tensor) -> MetricSums:
        """Fold the maximum of ``values`` (may be empty) into ``name``."""
        v = values.detach().to(_F64).reshape(-1)
        m = v.max() if v.numel() else torch.tensor(-math.inf, dtype=_F64, device=v.device)
        self.maxs[name] = torch.maximum(self.maxs[name], m) if name in self.maxs else m
        self._cache = None
        return self

    def merge(self, other: MetricSums) -> MetricSums:
        """A new accumulator holding both (micro-batches of one rank, or ranks gathered by hand)."""
        out = MetricSums(derived={**self.derived, **other.derived}, defaults={**self.defaults, **other.defaults})
        for src in (self, other):
            for k in src.sums:
                out.add_mean(k, src.sums[k], src.counts[k])
            for k, v in src.mins.items():
                out.add_min(k, v)
            for k, v in src.maxs.items():
                out.add_max(k, v)
        return out

    @staticmethod
    def merge_all(items: list[MetricSums]) -> MetricSums:
        """Merge a list (an empty list gives an empty accumulator)."""
        out = MetricSums()
        for item in items:
            out = out.merge(item)
        return out

    # -- cross-rank reduction ---------------------------------------------------------------------------------------
    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sums_and_counts, mins, maxs)`` as flat float64 vectors in sorted key order, for all-reduce."""
        keys = sorted(self.sums)
        dev = self._device()
        sc = torch.stack([self.sums[k] for k in keys] + [self.counts[k] for k in keys]) if keys else _empty(dev)
        mn = torch.stack([self.mins[k] for k in sorted(self.mins)]) if self.mins else _empty(dev)
        mx = torch.stack([self.maxs[k] for k in sorted(self.maxs)]) if self.maxs else _empty(dev)
        return sc, mn, mx

    def load_tensors(self, sums_and_counts: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> MetricSums:
        """Replace the accumulators by reduced vectors laid out as ``to_tensors`` returns them."""
        keys = sorted(self.sums)
        for i, k in enumerate(keys):
            self.sums[k], self.counts[k] = sums_and_counts[i], sums_and_counts[len(keys) + i]
        for i, k in enumerate(sorted(self.mins)):
            self.mins[k] = mins[i]
        for i, k in enumerate(sorted(self.maxs)):
            self.maxs[k] = maxs[i]
        self._cache = None
        return self

    def reduce(self, sum_op: ReduceOp, min_op: ReduceOp, max_op: ReduceOp) -> MetricSums:
        """Apply all-reduce callables (SUM, MIN, MAX) in place; each may reduce in place and return None."""
        sc, mn, mx = (t.clone() for t in self.to_tensors())
        sc = _apply(sum_op, sc)
        mn = _apply(min_op, mn)
        mx = _apply(max_op, mx)
        return self.load_tensors(sc, mn, mx)

    # -- results ----------------------------------------------------------------------------------------------------
    def finalize(self) -> dict[str, float]:
        """Means, mins, maxs and derived metrics as floats (one host sync); helpers (``_name``) are dropped."""
        if self._cache is not None:
            return dict(self._cache)
        keys = sorted(self.sums)
        sc, mn, mx = self.to_tensors()
        flat = torch.cat([sc.cpu(), mn.cpu(), mx.cpu()]).tolist()
        n = len(keys)
        counts = {k: flat[n + i] for i, k in enumerate(keys)}
        means = {k: (flat[i] / counts[k] if counts[k] > 0 else None) for i, k in enumerate(keys)}
        values: dict[str, float | None] = dict(means)
        values.update({k: _finite(flat[2 * n + i]) for i, k in enumerate(sorted(self.mins))})
        values.update({k: _finite(flat[2 * n + len(self.mins) + i]) for i, k in enumerate(sorted(self.maxs))})
        for name, (op, a, b) in self.derived.items():
            values[name] = _derive(op, means.get(a), means.get(b), counts.get(a, 0.0))
        out = {}
        for k, v in values.items():
            if k.startswith("_"):
                continue
            out[k] = float(self.defaults.get(k, 0.0)) if v is None else float(v)
        self._cache = out
        return dict(out)

    def _device(self):
        for d in (self.sums, self.mins, self.maxs):
            for v in d.values():
                return v.device
        return torch.device("cpu")

    # -- Mapping of the finalised values ---------------------------------------------------------------------------
    def __getitem__(self, key: str) -> float:
        return self.finalize()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.finalize())

    def __len__(self) -> int:
        return len(self.finalize())


def _empty(device) -> torch.Tensor:
    return torch.zeros(0, dtype=_F64, device=device)


def _apply(op: ReduceOp, t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return t
    out = op(t)
    return t if out is None else out


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _derive(op: str, mean: float | None, sq_mean: float | None, count: float) -> float | None:
    """std: sqrt((E[x^2] - E[x]^2) * n/(n-1)) (unbiased; 0 for n<=1); ess: E[w]^2 / E[w^2] (0 if all w = 0);
    total: E[x] * n."""
    if op == "total":
        return None if mean is None else mean * count
    if mean is None or sq_mean is None:
        return None
    if op == "std":
        if count <= 1:
            return 0.0
        return math.sqrt(max(sq_mean - mean * mean, 0.0) * count / (count - 1))
    if op == "ess":
        return mean * mean / sq_mean if sq_mean > 0 else 0.0  # all weights 0 (count > 0 here): no data
    raise ValueError(f"unknown derived metric op {op!r}; known: ess, std, total")
