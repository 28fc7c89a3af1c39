"""MetricSums: exact means/min/max/std/ess across merges and (simulated) all-reduces."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rlpipe.algos.metrics import MetricSums


def _acc(values):
    t = torch.tensor(values, dtype=torch.float64)
    m = MetricSums(derived={"x_std": ("std", "x_mean", "_x_sq"), "x_ess": ("ess", "x_mean", "_x_sq")},
                   defaults={"x_mean": 1.0})  # fmt: skip
    m.add_mean("x_mean", t.sum(), t.numel()).add_mean("_x_sq", t.square().sum(), t.numel())
    return m.add_min("x_min", t).add_max("x_max", t)


def test_finalize_matches_statistics():
    vals = [0.5, 2.0, 1.5, 3.0, 0.25]
    out = _acc(vals).finalize()
    assert set(out) == {"x_mean", "x_std", "x_ess", "x_min", "x_max"}  # helpers dropped
    assert out["x_mean"] == pytest.approx(statistics.mean(vals))
    assert out["x_std"] == pytest.approx(statistics.stdev(vals))
    assert out["x_ess"] == pytest.approx(sum(vals) ** 2 / (len(vals) * sum(v * v for v in vals)))
    assert (out["x_min"], out["x_max"]) == (0.25, 3.0)


def test_merge_and_reduce_equal_whole():
    a, b = [0.5, 2.0], [1.5, 3.0, 0.25]
    whole = _acc(a + b).finalize()
    merged = _acc(a).merge(_acc(b)).finalize()
    assert merged == pytest.approx(whole)
    # simulated 2-rank all-reduce: each rank's vectors combined with sum/min/max
    ranks = [_acc(a), _acc(b)]
    vecs = [r.to_tensors() for r in ranks]
    ops = [
        lambda t: vecs[0][0] + vecs[1][0],
        lambda t: torch.minimum(vecs[0][1], vecs[1][1]),
        lambda t: torch.maximum(vecs[0][2], vecs[1][2]),
    ]
    assert ranks[0].reduce(*ops).finalize() == pytest.approx(whole)
    # in-place ops that return None are supported (torch.distributed.all_reduce style)
    r = _acc(a)
    r.reduce(lambda t: t.mul_(2), lambda t: None, lambda t: None)
    assert r["x_mean"] == pytest.approx(statistics.mean(a))  # sums and counts doubled alike


def test_empty_defaults_and_mapping():
    m = _acc([])
    out = m.finalize()
    assert out["x_mean"] == 1.0  # default
    assert out["x_min"] == 0.0 and out["x_max"] == 0.0 and out["x_std"] == 0.0
    assert all(math.isfinite(v) for v in out.values())
    assert dict(m) == out and sorted(m) == sorted(out) and len(m) == len(out)
    assert MetricSums.merge_all([]).finalize() == {}
    single = _acc([2.0]).finalize()
    assert single["x_std"] == 0.0 and single["x_ess"] == 1.0


def test_cache_is_invalidated_on_update():
    m = MetricSums().add_mean("a", 1.0, 1)
    assert m["a"] == 1.0
    m.add_mean("a", 3.0, 1)
    assert m["a"] == 2.0


def test_counts_follow_the_device_of_their_sums():
    m = MetricSums().add_mean("a", torch.tensor(3.0), 2)
    assert m.counts["a"].device == m.sums["a"].device and m.counts["a"].dtype == torch.float64
    assert m["a"] == 1.5
