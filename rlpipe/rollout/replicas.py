"""`ReplicaPool`: several engine replicas serving one run, each kept verified by its own `EngineSync`.

The pool has the interface the loops use (`generate`, `generate_served`, `stage`, `ensure_current`, `lock`,
`stats`), so one replica and several go through the same code. Per update the policy is published once (a
collective on the trainer, on the driver's thread), the trainer's probe is scored once, and every replica loads and
verifies in parallel: its probe difference, its relative check and its own engine-side evidence; a replica that
fails verification stops the run with `WeightSyncError` naming it. Sampling routes the prompts
(`routing.assign_prompts`), runs the replicas in parallel and returns the generations in prompt order.

Faults: a replica whose server dies mid-rollout keeps what it finished; its failed prompts are re-sent to a live
replica (each prompt keeps its own seed, so its samples are what that replica would have drawn for it), and the dead
one is restarted from its last synced weights and re-verified before it samples again (`vllm.max_restarts` each).
A replica that cannot come back is dropped with a log line; with none left, `RolloutServerError`. Under NCCL sync
the trainer and every replica form one fixed group, so a failed replica stops the run instead (`rejoinable`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlpipe.errors import RolloutServerError, WeightSyncError
from rlpipe.rollout.engine import Generation, SamplingParams
from rlpipe.rollout.engine_sync import EngineSync, Publish, SyncStats, TrainerProbe
from rlpipe.rollout.probe import ProbeSequence
from rlpipe.rollout.routing import assign_prompts


def _publish_through_the_pool(*_args: Any) -> None:
    raise RuntimeError("a replica's EngineSync must not publish or score the trainer: the pool does it once")


class ReplicaPool:
    """N `EngineSync`s (one per replica) behind one sync: publish once, load and verify all, route prompts."""

    def __init__(self, syncs: list[EngineSync], publish: Publish, trainer_probe: TrainerProbe,
                 probe: list[ProbeSequence], max_new_tokens: int, publish_ahead: bool, rejoinable: bool = True,
                 log=print):  # fmt: skip
        if not syncs:
            raise ValueError("ReplicaPool needs at least one replica")
        self.syncs = syncs
        for s in syncs:  # collectives run on the driver's thread only, through the pool
            s.publish, s.trainer_probe = _publish_through_the_pool, _publish_through_the_pool
        self.publish, self.trainer_probe, self.probe = publish, trainer_probe, probe
        self.max_new_tokens, self.publish_ahead, self.log = max_new_tokens, publish_ahead, log
        self.rejoinable = rejoinable  # False under NCCL sync: the group is fixed when the run starts
        self.live = list(range(len(syncs)))
        self.lock = threading.RLock()
        self.dispatch_log: list[tuple[int, int, str]] = []  # (prompt index, replica, "ok" | "failed") of the last batch
        self._published: tuple[int, Any, list[list[float]]] | None = None  # version, artifact, trainer probe
        self._publish_s = self._staged_s = 0.0
        self._restarts = 0
        self._failed: dict[int, RolloutServerError] = {}  # replicas whose server failed in this batch

    # ------------------------------------------------------------------ identity and metrics
    @property
    def name(self) -> str:
        """Every live replica's name (its address), for the lineage manifest."""
        return " + ".join(self.syncs[i].engine.name for i in self.live)

    @property
    def engine(self):
        """The engine of a one-replica pool (what single-server tools and tests reach directly)."""
        if len(self.syncs) != 1:
            raise AttributeError(f"a pool of {len(self.syncs)} replicas has no single engine: use .syncs[i].engine")
        return self.syncs[0].engine

    @property
    def served_version(self) -> int | None:
        versions = {self.syncs[i].engine.served_version for i in self.live}
        return versions.pop() if len(versions) == 1 else None

    @property
    def stats(self) -> SyncStats:
        """One replica: its stats (and the pool's publish). Several: the slowest load and verify, the worst probe,
        and per-replica columns `engine/replica<i>/*`."""
        per = [self.syncs[i].stats for i in self.live]
        merged = SyncStats(
            syncs=max(s.syncs for s in per), publish_time_s=self._publish_s, staged_publish_time_s=self._staged_s,
            load_time_s=max(s.load_time_s for s in per), verify_time_s=max(s.verify_time_s for s in per),
            probe_max_abs_diff=max(s.probe_max_abs_diff for s in per),
            probe_separation=_nan_min([s.probe_separation for s in per]),
            probe_inconclusive=max(s.probe_inconclusive for s in per),
            check_time_s=max(s.check_time_s for s in per), restarts=self._restarts + sum(s.restarts for s in per),
            sync_bytes=sum(s.sync_bytes for s in per),
        )  # fmt: skip
        if len(self.syncs) == 1:
            merged.evidence = dict(per[0].evidence)
            return merged
        merged.evidence = {"engine/replicas_live": float(len(self.live))}
        for i in self.live:
            s, version = self.syncs[i].stats, self.syncs[i].engine.served_version
            merged.evidence.update({
                f"engine/replica{i}/weight_version": float(-1 if version is None else version),
                f"engine/replica{i}/probe_max_abs_diff": s.probe_max_abs_diff,
                f"engine/replica{i}/load_time_s": s.load_time_s,
                **{f"engine/replica{i}/{k.removeprefix('engine/')}": v for k, v in s.evidence.items()},
            })  # fmt: skip
        return merged

    @stats.setter
    def stats(self, value: SyncStats) -> None:
        """Reset (the loops assign a fresh `SyncStats()` before each sync)."""
        self._publish_s = self._staged_s = 0.0
        self._restarts = 0
        for s in self.syncs:
            s.stats = SyncStats()

    # ------------------------------------------------------------------ weights
    def stage(self, version: int) -> None:
        """Publish `version` and score the trainer's probe now (driver thread), before the engines load it."""
        if self.publish_ahead and self.served_version != version:
            start = time.perf_counter()
            if self._publish_once(version):
                self._staged_s += time.perf_counter() - start

    def ensure_current(self, version: int) -> None:
        with self.lock:
            self._sync_all(version)

    def _publish_once(self, version: int) -> bool:
        """Publish `version` unless already done; True if it published now."""
        if self._published is not None and self._published[0] == version:
            return False
        start = time.perf_counter()
        artifact = self.publish(version)
        self._published = (version, artifact, self.trainer_probe(self.probe))
        self._publish_s += time.perf_counter() - start
        return True

    def _sync_all(self, version: int) -> None:
        """Bring every live replica to `version`, in parallel; a dead one is restarted once per attempt."""
        stale = [i for i in self.live if self.syncs[i].engine.served_version != version]
        if not stale:
            return
        self._publish_once(version)
        _, artifact, trainer_lp = self._published
        for i in stale:
            self.syncs[i].use_published(version, artifact, trainer_lp)
        outcomes = self._parallel(stale, lambda i: self.syncs[i].ensure_current(version))
        for i, exc in outcomes.items():
            if exc is None:
                continue
            if isinstance(exc, WeightSyncError) or not isinstance(exc, RolloutServerError):
                raise exc  # a replica that loaded but does not verify stops the run, naming it
            if self._restart(i, exc):
                self.syncs[i].use_published(version, artifact, trainer_lp)
                self.syncs[i].ensure_current(version)
        self._require_live()

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[list[int]], params: SamplingParams, version: int) -> list[Generation]:
        """Sync every replica to `version` (driver thread), then sample."""
        with self.lock:
            self.stats = SyncStats()
            self._sync_all(version)
            return self._dispatch(prompts, params, version)

    def generate_served(self, prompts: list[list[int]], params: SamplingParams, version: int) -> tuple[list, int]:
        """Sample from replicas the driver already synced to `version` (any thread; never publishes)."""
        with self.lock:
            before = self._restarts
            gens = self._dispatch(prompts, params, version)
            return gens, self._restarts - before

    def _dispatch(self, prompts: list[list[int]], params: SamplingParams, version: int) -> list[Generation]:
        """Route, sample in parallel, re-send what a failed replica did not finish; generations in prompt order.
        Replicas that failed are restarted and re-verified before this returns."""
        self.dispatch_log = []
        done: dict[int, list[Generation]] = {}
        todo, attempt = list(range(len(prompts))), 0
        while todo:
            targets = self._sampling_replicas(version)
            routes = assign_prompts([len(prompts[i]) for i in todo], targets, params.n, self.max_new_tokens,
                                    salt=params.seed + attempt)  # fmt: skip
            batches = {r: [todo[j] for j in ids] for r, ids in routes.items() if ids}
            outcomes = _raise_bugs(
                self._parallel(list(batches), lambda r, b=batches: self._sample_on(r, prompts, b[r], params))
            )
            todo = []
            for r, (ok, failed) in outcomes.items():
                done.update(ok)
                self.dispatch_log += [(i, r, "ok") for i in sorted(ok)] + [(i, r, "failed") for i in sorted(failed)]
                if failed:
                    todo += failed
                    self._failed[r] = RolloutServerError(failed[min(failed)])
                    if not self.rejoinable:  # stop now, before re-sampling a batch that cannot finish
                        self._restart(r, self._failed[r])
            todo.sort()
            attempt += 1
        self._restart_failed(version)  # back with the last synced weights, verified, before the next batch
        return [g for i in range(len(prompts)) for g in done[i]]

    def _sample_on(self, r: int, prompts: list[list[int]], ids: list[int], params: SamplingParams):
        """(done, failed) of replica `r`; a replica that cannot answer at all failed every prompt."""
        engine = self.syncs[r].engine
        try:
            if hasattr(engine, "generate_each"):
                return engine.generate_each([prompts[i] for i in ids], params, ids)
            gens = engine.generate([prompts[i] for i in ids], params)  # all or nothing (engines without per-prompt
        except RolloutServerError as exc:  # results)
            return {}, dict.fromkeys(ids, str(exc))
        done: dict[int, list[Generation]] = {i: [] for i in ids}
        for g in gens:
            g.prompt_index = ids[g.prompt_index]
            done[g.prompt_index].append(g)
        return done, {}

    def _sampling_replicas(self, version: int) -> list[int]:
        """Live replicas that have not failed in this batch; if none is left, restart (and re-verify) the failed."""
        ready = [i for i in self.live if i not in self._failed]
        if ready:
            return ready
        self._restart_failed(version)
        return self._require_live()

    def _restart_failed(self, version: int) -> None:
        """Restart every replica that failed in this batch and re-verify it against `version`'s cached probe."""
        for i in list(self._failed):
            if self._restart(i, self._failed[i]):
                self.syncs[i].expect_served(version)

    def _restart(self, i: int, exc: RolloutServerError) -> bool:
        """Restart replica `i` (bounded); drop it from the pool once its restarts are spent. True if it is back.

        A failure that is not a crash (a server rlpipe does not own, or one still alive that answered wrongly)
        raises `exc` itself, as with one engine: the run stops with the server's own error. Neither restart nor
        drop is possible when the replicas share the trainer's NCCL group (`rejoinable=False`): a restarted server
        is not in the group and a dead member blocks every broadcast, so the run stops, to resume from its last
        checkpoint."""
        self._failed.pop(i, None)
        if not self.rejoinable:
            raise RolloutServerError(
                f"{self.syncs[i].engine.name} failed ({exc}); with rollout.weight_sync.method=nccl a restarted server "
                "cannot rejoin the trainer's NCCL group, so the run stops: resume it from its last checkpoint"
            ) from exc
        try:
            self.syncs[i].restart_or_raise(exc)
        except RolloutServerError as final:
            if final is exc:
                raise
            self.log(f"dropping {self.syncs[i].engine.name} from the pool: {final}")
            self.live.remove(i)
            return False
        self._restarts += 1
        return True

    def _require_live(self) -> list[int]:
        if not self.live:
            raise RolloutServerError("every engine replica failed and could not be restarted (see the log above)")
        return list(self.live)

    # ------------------------------------------------------------------ plumbing
    def _parallel(self, ids: list[int], fn: Callable[[int], Any]) -> dict[int, Any]:
        """fn(i) for every i at once (one thread each); exceptions are returned, not raised."""
        if len(ids) == 1:
            return {ids[0]: _capture(fn, ids[0])}
        with ThreadPoolExecutor(max_workers=len(ids)) as pool:
            futures = {i: pool.submit(_capture, fn, i) for i in ids}
            return {i: f.result() for i, f in futures.items()}

    def close(self) -> None:
        self._parallel(list(range(len(self.syncs))), lambda i: self.syncs[i].close())


def _capture(fn: Callable[[int], Any], i: int) -> Any:
    try:
        return fn(i)
    except Exception as exc:  # noqa: BLE001 (returned to the caller, which decides)
        return exc


def _raise_bugs(outcomes: dict[int, Any]) -> dict[int, Any]:
    """Exceptions that are not a replica's failure (bugs) are raised, not treated as a dead server."""
    for value in outcomes.values():
        if isinstance(value, Exception) and not isinstance(value, RolloutServerError):
            raise value
    return outcomes


def _nan_min(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return min(finite) if finite else float("nan")
