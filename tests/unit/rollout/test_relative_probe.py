"""The relative weight-sync check (issue 33): a stale engine that the absolute tolerance lets through is caught."""

from __future__ import annotations

import math

import pytest

from rlpipe.errors import WeightSyncError
from rlpipe.rollout.engine import Generation, SamplingParams
from rlpipe.rollout.engine_sync import EngineSync
from rlpipe.rollout.probe import ProbeSequence, check_relative_probe, default_probe_tolerance, relative_probe


def test_relative_probe_math_against_hand_computed_values():
    old, new, eng = [[-1.0, -2.0]], [[-1.2, -2.0]], [[-1.15, -2.0]]
    r = relative_probe(eng, new, old, noise_rms=0.03)
    # by hand: update (-0.2, 0); engine - old = (-0.15, 0); shown = 0.03 / 0.04 = 0.75
    # separation = (|e-old|^2 - |e-new|^2) / |upd|^2 = (0.0225 - 0.0025) / 0.04 = 0.5
    assert math.isclose(r.shown, 0.75) and math.isclose(r.separation, 0.5)
    assert math.isclose(r.update_l2, 0.2) and math.isclose(r.max_update, 0.2)
    assert math.isclose(r.engine_old_max_abs_diff, 0.15)
    assert not r.inconclusive  # 0.2 >= 6 * 0.03
    assert relative_probe(eng, new, old, noise_rms=0.04).inconclusive  # 0.2 < 6 * 0.04
    stale = relative_probe(old, new, old, noise_rms=0.01)
    assert stale.shown == 0.0 and stale.separation == -1.0
    with pytest.raises(
        WeightSyncError, match=r"e1 .*version 2's weights after syncing version 3.*show 0 of the update"
    ):
        check_relative_probe(stale, "e1", version=3, previous=2)
    check_relative_probe(r, "e1", 3, 2)  # synced enough: no error
    same = relative_probe(old, old, old, noise_rms=0.01)  # no update at all: nothing to tell apart
    assert same.inconclusive and math.isnan(same.shown)
    check_relative_probe(same, "e1", 3, 2)


class NoisyFakeEngine:
    """Serves a float `weight` per version; scores each probe token as -weight + a fixed per-token noise."""

    name = "fake http://x"

    def __init__(self, skip_loads_after: int | None = None, noise: float = 0.0):
        self.served_version, self.weight, self.loads = None, None, 0
        self.skip_loads_after, self.noise = skip_loads_after, noise

    def load_weights(self, serving_dir, version):
        self.loads += 1
        if self.skip_loads_after is None or self.loads <= self.skip_loads_after:
            self.weight = float(serving_dir)
        self.served_version = version

    def score(self, prompt_ids, response_ids):
        return [-self.weight + self.noise * (-1) ** j for j in range(len(response_ids))]

    def generate(self, prompts, params):
        return [Generation(i, 0, [3], [-self.weight], "stop") for i in range(len(prompts))]


def _sync(engine, step: float, tolerance: float, tokens: int = 8):
    """Version v's weights are `step * v`; the trainer scores each probe token as -weight (what it holds)."""
    published: list[int] = []

    def publish(version):
        published.append(version)
        return str(step * version)

    def trainer_probe(seqs):
        return [[-step * published[-1]] * len(s.response_ids) for s in seqs]

    probe = [ProbeSequence([1, 2], list(range(3, 3 + tokens))) for _ in range(2)]
    return EngineSync(engine, publish, trainer_probe, probe, tolerance, log=lambda m: None)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_stale_engine_within_the_absolute_tolerance_fails_at_its_first_stale_sync(dtype):
    tol = default_probe_tolerance(dtype)
    step = tol / 2  # one update moves every probe logprob by half the tolerance: the absolute check's blind spot
    engine = NoisyFakeEngine(skip_loads_after=2)
    sync = _sync(engine, step, tol)
    sync.generate([[1]], SamplingParams(n=1), 0)
    assert sync.stats.probe_inconclusive == 1.0  # the first sync has no previous version to be stale against
    sync.generate([[1]], SamplingParams(n=1), 1)
    assert sync.stats.probe_separation == pytest.approx(1.0) and sync.stats.probe_inconclusive == 0.0
    with pytest.raises(WeightSyncError, match=r"fake http://x .*version 1's weights after syncing version 2"):
        sync.generate([[1]], SamplingParams(n=1), 2)  # the third load is skipped: engine keeps version 1
    assert sync.stats.probe_max_abs_diff == pytest.approx(step) and step < tol  # the absolute check passed it
    assert sync.stats.probe_separation == pytest.approx(-1.0) and engine.served_version is None


def test_a_synced_engine_with_bf16_sized_noise_passes_and_reports_separation():
    tol = default_probe_tolerance("bf16")
    engine = NoisyFakeEngine(noise=0.02)  # +-0.02 per token around the trainer's logprobs
    sync = _sync(engine, step=0.06, tolerance=tol)
    for v in range(3):
        sync.generate([[1]], SamplingParams(n=1), v)
    # the alternating noise is orthogonal to the (uniform) update: shown = 1 exactly
    assert sync.stats.probe_separation == pytest.approx(1.0) and sync.stats.probe_inconclusive == 0.0
    assert sync.stats.probe_max_abs_diff == pytest.approx(0.02)
    row = sync.stats.row(2)
    assert row["engine/check_time_s"] >= 0 and row["engine/probe_separation"] == pytest.approx(1.0)


def test_an_update_under_the_noise_floor_is_reported_inconclusive_not_failed():
    tol = default_probe_tolerance("bf16")
    engine = NoisyFakeEngine(skip_loads_after=1)
    sync = _sync(engine, step=0.005, tolerance=tol)  # |update| over 16 tokens = 0.02 < 6 * 0.025
    sync.generate([[1]], SamplingParams(n=1), 0)
    sync.generate([[1]], SamplingParams(n=1), 1)  # stale, but indistinguishable from bf16 noise: say so
    assert sync.stats.probe_inconclusive == 1.0 and sync.stats.probe_separation == pytest.approx(-1.0)
    assert engine.served_version == 1
