"""`EngineSync`: keeps a `SyncableEngine` serving the trainer's current weights, verified, across restarts.

The session calls `generate(prompts, params, version)` with the policy's version (its optimizer step). If the engine
serves another version, the policy is published (`publish(version) -> dir`, a collective on the trainer) and loaded,
then the probe is scored by both sides and compared. A managed server that died is restarted from the last
published weights, re-verified, and the request retried once; an unmanaged one fails with its error.

With `rollout.max_staleness >= 1` (`rlpipe.loop_async`) a producer thread samples while the driver trains. `lock` is
held around every generate call and every sync, so weights never change in the middle of a batch. The producer calls
`generate_served`, which never publishes: publishing is a collective on the training workers, and the driver's thread
is the only one that calls them (two threads calling the same actors could order the collectives differently on
different ranks and deadlock).

`stage(version)` lets the pipelined loop publish the new weights (and score the trainer's side of the probe) while
the producer still samples from the engine: a disk publish writes a new versioned directory and leaves the served
one alone (`write_serving_dir` keeps the newest two), so only the engine's load and its probe wait for the lock. A
publisher that streams into the server (NCCL) changes the served weights itself, so it is never staged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rlpipe.errors import RolloutServerError, WeightSyncError
from rlpipe.rollout.engine import Generation, SamplingParams
from rlpipe.rollout.probe import (
    ProbeSequence,
    check_probe,
    check_relative_probe,
    compare_probe,
    default_probe_noise,
    relative_probe,
    score_probe,
)
from rlpipe.rollout.serving_dir import published_bytes

Publish = Callable[[int], str | None]  # the serving dir, or None when streamed
TrainerProbe = Callable[[list[ProbeSequence]], list[list[float]]]


@dataclass
class SyncStats:
    """What the last `generate` did about weights (one metrics row's `engine/*` columns)."""

    syncs: int = 0
    publish_time_s: float = 0.0
    staged_publish_time_s: float = 0.0  # the part of publish_time_s spent in `stage`, outside the engine lock
    load_time_s: float = 0.0
    verify_time_s: float = 0.0
    probe_max_abs_diff: float = 0.0
    probe_separation: float = float("nan")  # relative check: 1 synced, -1 stale (`relative_probe`); NaN: not run
    probe_inconclusive: float = 0.0  # 1: the update was too small for the relative check (or no previous version)
    check_time_s: float = 0.0  # the part of load + verify spent on the stale-engine checks (relative, engine-side)
    restarts: int = 0
    evidence: dict[str, float] = field(default_factory=dict)  # the engine's own checks (`last_check_metrics`)
    sync_bytes: int = 0  # bytes of the published weight files the engine loaded (LoRA: the adapter only)

    def sync_metrics(self) -> dict[str, float]:
        """What syncing cost and how close the probe came: the `engine/*` columns of a sync."""
        return {
            "engine/syncs": float(self.syncs),
            "engine/sync_time_s": self.publish_time_s + self.load_time_s + self.verify_time_s,
            # what the trainer waited for the sync (the staged publish overlapped sampling)
            "engine/sync_blocking_time_s": self.publish_time_s
            - self.staged_publish_time_s
            + self.load_time_s
            + self.verify_time_s,
            "engine/publish_time_s": self.publish_time_s,
            "engine/staged_publish_time_s": self.staged_publish_time_s,
            "engine/load_time_s": self.load_time_s,
            "engine/verify_time_s": self.verify_time_s,
            "engine/probe_max_abs_diff": self.probe_max_abs_diff,
            "engine/probe_separation": self.probe_separation,
            "engine/probe_inconclusive": self.probe_inconclusive,
            "engine/check_time_s": self.check_time_s,
            "engine/sync_bytes": float(self.sync_bytes),
            **self.evidence,
        }

    def row(self, version: int | None) -> dict[str, float]:
        """`sync_metrics` plus the version served and the restarts: the `engine/*` columns of a rollout."""
        return {
            "engine/weight_version": float(-1 if version is None else version),
            **self.sync_metrics(),
            "engine/restarts": float(self.restarts),
        }


class EngineSync:
    """The driver-side owner of a syncable engine: lazy, verified syncs and crash recovery."""

    def __init__(
        self,
        engine,
        publish: Publish,
        trainer_probe: TrainerProbe,
        probe: list[ProbeSequence],
        tolerance: float,
        max_restarts: int = 2,
        log=print,
        publish_ahead: bool = False,
        noise_rms: float | None = None,
    ):
        self.engine = engine
        self.publish = publish
        self.publish_ahead = publish_ahead  # True only when `publish` writes a directory the engine loads later
        self.trainer_probe = trainer_probe
        self.probe = probe
        self.tolerance = tolerance
        self.noise_rms = default_probe_noise(tolerance) if noise_rms is None else noise_rms
        self.max_restarts = max_restarts
        self.log = log
        self.restarts = 0
        self.stats = SyncStats()
        self._probe_cache: tuple[int, list[list[float]]] | None = None  # trainer logprobs of the probe per version
        self._previous_probe: tuple[int, list[list[float]]] | None = None  # the version synced before, for the
        # relative check: a stale engine matches it better than the new one
        self.lock = threading.RLock()  # held by every generate and sync: no sync in the middle of a batch
        # (version, its serving dir, the trainer's probe logprobs, publish seconds) written by `stage`, not loaded yet;
        # driver thread only
        self._staged: tuple[int, str | None, list[list[float]], float] | None = None

    def ensure_current(self, version: int) -> None:
        """Publish and load `version` unless the engine already serves it (verified)."""
        with self.lock:
            self._ensure_current(version)

    def stage(self, version: int) -> None:
        """Publish `version` and score the trainer's probe now, without the lock; the next `ensure_current(version)`
        only loads and verifies. A no-op unless `publish_ahead` (see the module docstring). Driver thread only."""
        if not self.publish_ahead or self.engine.served_version == version:
            return
        if self._staged is not None and self._staged[0] == version:
            return
        start = time.perf_counter()
        serving_dir = self.publish(version)
        self._staged = (version, serving_dir, self.trainer_probe(self.probe), time.perf_counter() - start)

    def use_published(self, version: int, artifact: str | None, trainer_logprobs: list[list[float]]) -> None:
        """`version` was published (and the trainer's probe scored) by someone else, a `ReplicaPool` for all its
        replicas: the next `ensure_current(version)` only loads `artifact` and verifies."""
        self._staged = (version, artifact, trainer_logprobs, 0.0)

    def _ensure_current(self, version: int) -> None:
        if self.engine.served_version == version:
            return
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] == version:
            _, serving_dir, trainer_lp, publish_s = staged
            self._set_probe(version, trainer_lp)
            self.stats.staged_publish_time_s += publish_s
        else:
            start = time.perf_counter()
            serving_dir = self.publish(version)
            publish_s = time.perf_counter() - start
        published = time.perf_counter()
        self.engine.load_weights(serving_dir, version)
        loaded = time.perf_counter()
        self.verify(version)
        self.stats.syncs += 1
        self.stats.sync_bytes += getattr(self.engine, "last_load_bytes", 0) or published_bytes(serving_dir)
        self.stats.publish_time_s += publish_s
        self.stats.load_time_s += loaded - published
        self.stats.verify_time_s += time.perf_counter() - loaded
        self.stats.check_time_s += getattr(self.engine, "last_check_s", 0.0)  # engine-side evidence, in load_time_s
        self.stats.evidence = dict(getattr(self.engine, "last_check_metrics", {}))

    def _set_probe(self, version: int, trainer_lp: list[list[float]]) -> None:
        """Cache `version`'s trainer probe; the one it replaces becomes the previous version's."""
        if self._probe_cache is not None and self._probe_cache[0] != version:
            self._previous_probe = self._probe_cache
        self._probe_cache = (version, trainer_lp)

    def verify(self, version: int) -> None:
        """Score the probe on the engine and (once per version) on the trainer; raise `WeightSyncError` if apart
        (absolute tolerance) or if the engine is nearer the previous version's weights than this one's (relative)."""
        if self._probe_cache is None or self._probe_cache[0] != version:
            self._set_probe(version, self.trainer_probe(self.probe))
        engine_lp = score_probe(self.engine, self.probe)
        result = compare_probe(engine_lp, self._probe_cache[1])
        self.stats.probe_max_abs_diff = result.max_abs_diff
        try:
            check_probe(result, self.tolerance, self.engine.name, version)
            self._check_relative(engine_lp, version)
        except BaseException:
            self.engine.served_version = None  # never trust these weights again without a new load
            raise

    def _check_relative(self, engine_lp: list[list[float]], version: int) -> None:
        start = time.perf_counter()
        prev = self._previous_probe
        if prev is None:  # the first sync: nothing to be stale against (the server started from the base weights)
            self.stats.probe_separation, self.stats.probe_inconclusive = float("nan"), 1.0
            return
        rel = relative_probe(engine_lp, self._probe_cache[1], prev[1], self.noise_rms)
        self.stats.probe_separation, self.stats.probe_inconclusive = rel.separation, float(rel.inconclusive)
        self.stats.check_time_s += time.perf_counter() - start
        check_relative_probe(rel, self.engine.name, version, prev[0])

    def generate(self, prompts: list[list[int]], params: SamplingParams, version: int) -> list[Generation]:
        """Sample from the engine serving `version`; a dead managed server is restarted (bounded) and retried."""
        with self.lock:
            self.stats = SyncStats()
            while True:
                try:
                    self._ensure_current(version)
                    return self.engine.generate(prompts, params)
                except RolloutServerError as exc:
                    self.restart_or_raise(exc)
                    self.stats.restarts += 1

    def generate_served(self, prompts: list[list[int]], params: SamplingParams, version: int) -> tuple[list, int]:
        """Sample from the engine that the driver already synced to `version`; returns (generations, restarts).

        For a thread other than the driver's: it never publishes. A managed server that died restarts from the
        served directory (that version's) and is re-verified against the trainer probe cached by the driver's sync.
        """
        restarts = 0
        with self.lock:
            while True:
                try:
                    self.expect_served(version)
                    return self.engine.generate(prompts, params), restarts
                except RolloutServerError as exc:
                    self.restart_or_raise(exc)
                    restarts += 1

    def expect_served(self, version: int) -> None:
        """Check the engine serves `version`; after a restart, re-verify it against the cached trainer probe."""
        if self.engine.served_version == version:
            return
        if self._probe_cache is None or self._probe_cache[0] != version:
            raise WeightSyncError(
                f"{self.engine.name} serves version {self.engine.served_version}, the batch needs {version}, and the "
                "driver has not synced it (a producer thread never publishes weights)"
            )
        self.verify(version)  # restarted from this version's directory: verify it before trusting it
        self.engine.served_version = version

    def restart_or_raise(self, exc: RolloutServerError) -> None:
        """Restart a managed server that died (bounded by `max_restarts`); re-raise anything else."""
        if not self._should_restart(exc):
            raise exc
        self.restarts += 1
        self.log(f"{self.engine.name} failed ({exc}); restarting it ({self.restarts}/{self.max_restarts})")
        self.engine.restart()

    def _should_restart(self, exc: RolloutServerError) -> bool:
        if isinstance(exc, WeightSyncError) or not getattr(self.engine, "restartable", False):
            return False
        if self._still_alive(grace_s=10.0):
            return False  # a live server that errs is a bug to report, not a crash to paper over
        if self.restarts >= self.max_restarts:
            raise RolloutServerError(
                f"{self.engine.name} died again after {self.restarts} restarts; giving up: {exc}"
            ) from exc
        return True

    def _still_alive(self, grace_s: float) -> bool:
        """Whether the server is alive `grace_s` after an error: a killed server resets connections a moment before
        its process is gone, so a single check right after the error can still see it running."""
        deadline = time.monotonic() + grace_s
        while self.engine.alive():
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.2)
        return False

    def close(self) -> None:
        self.engine.close()
