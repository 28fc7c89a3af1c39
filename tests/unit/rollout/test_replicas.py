"""ReplicaPool and prompt routing without servers: fake replicas whose 'weights' are a number and whose samples
say which replica drew them, so every routing, sync and failover decision is visible."""

from __future__ import annotations

import threading

import pytest

from rlpipe.errors import RolloutServerError, WeightSyncError
from rlpipe.rollout.engine import Generation, SamplingParams
from rlpipe.rollout.engine_sync import EngineSync
from rlpipe.rollout.probe import ProbeSequence
from rlpipe.rollout.replicas import ReplicaPool
from rlpipe.rollout.routing import assign_prompts


class FakeReplica:
    """Serves weights = the float version; a sample's token is 1000 * replica + prompt index."""

    restartable = True

    def __init__(self, index: int):
        self.index, self.name = index, f"fake replica {index}"
        self.served_version: int | None = None
        self.weights = 0.0
        self.loads: list[int] = []
        self.requests: list[int] = []
        self.dead = False
        self.die_after: int | None = None  # die once this many prompts were answered in a batch
        self.stale = False  # pretend to load but keep the old weights
        self.restarts = 0
        self.threads: set[str] = set()

    def load_weights(self, artifact, version: int) -> None:
        self.threads.add(threading.current_thread().name)
        if self.dead:
            raise RolloutServerError(f"{self.name}: connection refused")
        self.loads.append(version)
        if not self.stale:
            self.weights = float(artifact)
        self.served_version = version

    def score(self, prompt_ids, response_ids):
        if self.dead:
            raise RolloutServerError(f"{self.name}: connection refused")
        return [-self.weights] * len(response_ids)

    def generate_each(self, prompts, params, indices):
        done, failed = {}, {}
        for _prompt, i in zip(prompts, indices, strict=True):
            if self.die_after is not None and len(done) >= self.die_after:
                self.dead, self.die_after = True, None
            if self.dead:
                failed[i] = f"{self.name}: connection reset"
                continue
            self.requests.append(i)
            done[i] = [Generation(i, s, [1000 * self.index + i], [0.0], "stop") for s in range(params.n)]
        return done, failed

    def alive(self) -> bool:
        return not self.dead

    def restart(self) -> None:
        self.dead, self.restarts, self.served_version = False, self.restarts + 1, None

    def close(self) -> None:
        pass


def _pool(n: int, max_restarts: int = 2, rejoinable: bool = True):
    replicas = [FakeReplica(i) for i in range(n)]
    published: list[int] = []
    trainer_calls: list[str] = []

    def publish(version):
        published.append(version)
        return str(version)

    def trainer_probe(seqs):
        trainer_calls.append(threading.current_thread().name)
        return [[-float(published[-1])] * len(s.response_ids) for s in seqs]

    probe = [ProbeSequence([1], [2, 3])]
    syncs = [EngineSync(r, None, None, probe, 1e-6, max_restarts=max_restarts, log=lambda m: None) for r in replicas]
    for s in syncs:
        s._still_alive = lambda grace_s, s=s: s.engine.alive()  # no 10 s grace in a unit test
    pool = ReplicaPool(syncs, publish, trainer_probe, probe, max_new_tokens=4, publish_ahead=True,
                       rejoinable=rejoinable, log=lambda m: None)  # fmt: skip
    return pool, replicas, published, trainer_calls


PARAMS = SamplingParams(n=2, max_new_tokens=4, seed=7)


def test_assignment_balances_pending_work_deterministically():
    lengths = [10] * 8 + [50, 50]
    a = assign_prompts(lengths, [0, 1], n=2, max_new_tokens=5, salt=3)
    assert a == assign_prompts(lengths, [0, 1], n=2, max_new_tokens=5, salt=3)
    assert sorted(a[0] + a[1]) == list(range(10))
    work = {r: sum(lengths[i] + 10 for i in ids) for r, ids in a.items()}
    assert abs(work[0] - work[1]) <= 60  # greedy least-pending: within one prompt's work
    assert assign_prompts(lengths, [0], 2, 5, 3) == {0: list(range(10))}


def test_one_publish_and_one_trainer_probe_per_update_for_every_replica():
    pool, replicas, published, trainer_calls = _pool(3)
    gens = pool.generate([[5, i] for i in range(9)], PARAMS, version=4)
    assert published == [4] and len(trainer_calls) == 1
    assert trainer_calls == [threading.current_thread().name]  # collectives on the caller's thread only
    assert [r.loads for r in replicas] == [[4], [4], [4]]
    assert [g.prompt_index for g in gens] == [i for i in range(9) for _ in range(2)]  # prompt order
    assert {g.response_ids[0] // 1000 for g in gens} == {0, 1, 2}  # all three sampled
    pool.generate([[5, i] for i in range(9)], PARAMS, version=4)
    assert published == [4]  # already served: no new sync
    stats = pool.stats.sync_metrics()
    assert stats["engine/replicas_live"] == 3.0 and stats["engine/replica2/weight_version"] == 4.0


def test_a_replica_that_loads_stale_weights_stops_the_run_naming_it():
    pool, replicas, _, _ = _pool(2)
    pool.generate([[1]], PARAMS, version=1)
    replicas[1].stale = True
    with pytest.raises(WeightSyncError, match="fake replica 1"):
        pool.generate([[1]], PARAMS, version=2)


def test_a_replica_dying_mid_batch_loses_no_prompt_and_samples_none_twice():
    pool, replicas, _, _ = _pool(2)
    prompts = [[5, i] for i in range(10)]
    replicas[0].die_after = 2  # answers two of its prompts, then its server is gone
    gens = pool.generate(prompts, PARAMS, version=3)
    assert [g.prompt_index for g in gens] == [i for i in range(10) for _ in range(2)]
    ok = [i for i, _, outcome in pool.dispatch_log if outcome == "ok"]
    assert sorted(ok) == list(range(10))  # every prompt answered exactly once
    failed = [i for i, r, outcome in pool.dispatch_log if outcome == "failed"]
    assert failed and all(r == 0 for _, r, o in pool.dispatch_log if o == "failed")
    assert set(failed) <= set(replicas[1].requests)  # re-sent to the live replica
    assert not set(replicas[0].requests) & set(replicas[1].requests)  # nothing drawn twice
    assert replicas[0].restarts == 1 and replicas[0].served_version == 3  # back, re-verified, for the next batch
    assert pool.stats.restarts == 1


def test_a_single_replica_that_dies_is_restarted_and_resumes_its_own_prompts():
    pool, replicas, _, _ = _pool(1)
    replicas[0].die_after = 3
    gens = pool.generate([[5, i] for i in range(6)], PARAMS, version=1)
    assert [g.prompt_index for g in gens] == [i for i in range(6) for _ in range(2)]
    assert sorted(replicas[0].requests) == list(range(6)) and replicas[0].restarts == 1


def test_with_every_replica_gone_the_error_is_clear():
    pool, replicas, _, _ = _pool(2, max_restarts=0)
    pool.generate([[1]], PARAMS, version=1)
    for r in replicas:
        r.dead = True
    with pytest.raises(RolloutServerError, match="every engine replica failed"):
        pool.generate([[5, i] for i in range(4)], PARAMS, version=1)


def test_a_replica_that_cannot_come_back_is_dropped_and_the_rest_serve():
    pool, replicas, _, _ = _pool(2, max_restarts=0)
    pool.generate([[1]], PARAMS, version=1)
    replicas[1].dead = True
    gens = pool.generate([[5, i] for i in range(4)], PARAMS, version=1)
    assert len(gens) == 8 and pool.live == [0]
    pool.generate([[1]], PARAMS, version=2)
    assert replicas[0].loads == [1, 2] and replicas[1].loads == [1]


def test_under_one_nccl_group_a_failed_replica_stops_the_run_instead_of_restarting_or_dropping():
    pool, replicas, published, _ = _pool(2, rejoinable=False)
    pool.generate([[1]], PARAMS, version=1)
    replicas[0].die_after = 1  # mid-batch
    with pytest.raises(RolloutServerError, match="cannot rejoin the trainer's NCCL group.*last checkpoint"):
        pool.generate([[5, i] for i in range(6)], PARAMS, version=1)
    assert replicas[0].restarts == 0 and pool.live == [0, 1]
    replicas[0].dead = True  # dead at the next sync too
    with pytest.raises(RolloutServerError, match="cannot rejoin"):
        pool.generate([[1]], PARAMS, version=2)
    assert replicas[0].restarts == 0 and published == [1, 2]


def test_staged_publish_is_reused_by_the_sync():
    pool, replicas, published, trainer_calls = _pool(2)
    pool.stage(5)
    pool.ensure_current(5)
    assert published == [5] and len(trainer_calls) == 1 and [r.loads for r in replicas] == [[5], [5]]
    assert pool.stats.staged_publish_time_s > 0


def test_a_server_rlpipe_does_not_own_fails_with_its_own_error():
    pool, replicas, _, _ = _pool(2)
    pool.generate([[1]], PARAMS, version=1)
    replicas[1].restartable = False
    replicas[1].dead = True
    with pytest.raises(RolloutServerError, match="fake replica 1: connection"):
        pool.generate([[5, i] for i in range(4)], PARAMS, version=2)
    assert pool.live == [0, 1]  # not dropped: the run stops instead, naming the server
