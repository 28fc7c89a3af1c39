"""The bounded-staleness loop (rlpipe.loop_async) with a fake engine and a fake trainer: schedule, overlap, where
syncs happen, errors. Fast: no Ray, no model."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pandas as pd
import pytest

from rlpipe.config import load_config
from rlpipe.errors import ConfigError, RolloutServerError
from rlpipe.loop_async import AsyncLoop, DriftMonitor, check_staleness, sampled_from
from rlpipe.rollout.engine import Generation
from rlpipe.rollout.engine_sync import EngineSync
from rlpipe.rollout.probe import ProbeSequence

WAIT = 10.0  # seconds a fake side waits for the other before declaring the loop synchronous


def test_drift_warns_once_on_a_sustained_mismatch_and_never_on_a_spike():
    quiet = DriftMonitor(k=1, window=4, threshold=0.05)
    # one spike of 0.12 among small gaps: the 4-iteration mean peaks at (0.12 + 3 * 0.01) / 4 = 0.0375
    assert [quiet.observe(t, kl) for t, kl in enumerate([0.01, 0.01, 0.12, 0.01, 0.01, 0.01], 1)] == [None] * 6
    loud = DriftMonitor(k=1, window=4, threshold=0.05)
    said = [loud.observe(t, kl) for t, kl in enumerate([0.2, 0.2, 0.2, 0.01, 0.01, 0.3, 0.3, 0.3], 1)]
    # the first full window (iteration 4: mean 0.1525, printed 0.153) warns; later windows over it do not repeat it
    assert said[:3] == [None] * 3 and all(w is None for w in said[4:])
    assert "iteration 4" in said[3] and "0.153" in said[3] and "train.lr" in said[3]
    # exactly at the threshold is not over it
    edge = DriftMonitor(k=2, window=2, threshold=0.05)
    assert edge.observe(1, 0.05) is None and edge.observe(2, 0.05) is None


def test_schedule_is_k_updates_behind_and_never_before_the_origin():
    # iteration j trains a batch sampled from the weights after iteration max(origin, j - 1 - k), written out
    assert [sampled_from(j, 1, 0) for j in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [sampled_from(j, 2, 0) for j in range(1, 7)] == [0, 0, 0, 1, 2, 3]
    assert [sampled_from(j, 1, 5) for j in range(6, 10)] == [5, 5, 6, 7]
    assert check_staleness(4, 2, 1) == 1 and check_staleness(1, 0, 1) == 0
    with pytest.raises(RuntimeError, match=r"staleness 2\), outside"):
        check_staleness(4, 1, 1)
    with pytest.raises(RuntimeError, match=r"staleness -1\)"):
        check_staleness(2, 2, 1)


class Engine:
    """Serves a float weight per version; records every batch (version, thread) and refuses mid-batch loads."""

    name, restartable = "fake", False

    def __init__(self):
        self.served_version, self.served_dir, self.weight = None, None, None
        self.busy = False
        self.batches: list[tuple[int, str]] = []
        self.loads: list[int] = []
        self.before_batch = lambda: None

    def load_weights(self, serving_dir, version):
        assert not self.busy, "a weight load inside a batch"
        self.weight, self.served_version, self.served_dir = float(serving_dir), version, serving_dir
        self.loads.append(version)

    def score(self, prompt_ids, response_ids):
        return [-self.weight] * len(response_ids)

    def generate(self, prompts, params):
        self.busy = True
        try:
            self.before_batch()
            time.sleep(0.01)
            self.batches.append((self.served_version, threading.current_thread().name))
            return [Generation(i, s, [3], [-self.weight], "stop") for i in range(len(prompts)) for s in range(params.n)]
        finally:
            self.busy = False

    def alive(self):
        return True

    def close(self):
        pass


class Session:
    """What AsyncLoop uses of an RLSession: each update adds 1 to the weights' version (optimizer step)."""

    def __init__(self, k: int, iterations: int, engine: Engine):
        self.cfg = SimpleNamespace(rollout=SimpleNamespace(max_staleness=k), iterations=iterations)
        self.schedule = SimpleNamespace(sft_due=lambda t: False, eval_due=lambda t: False)
        self.counters = SimpleNamespace(iteration=0, step=0)
        self.publish_threads: list[str] = []
        self.trained: list[tuple[int, float]] = []  # (iteration, version the batch was sampled with)
        self.run = SimpleNamespace(save_hooks=[])
        self.next_prompt = 0
        self.during_train = lambda t: None
        self.mismatch_kl = lambda t: 0.0  # what the trainer reports as mismatch/mismatch_kl for iteration t

        def publish(version):
            self.publish_threads.append(threading.current_thread().name)
            return str(version)  # the weights of version v are the float v

        def trainer_probe(seqs):
            return [[-float(self.counters.step)] * len(s.response_ids) for s in seqs]

        sync = EngineSync(engine, publish, trainer_probe, [ProbeSequence([1], [3])], 1e-9, log=print)
        self.rollout_source = SimpleNamespace(sync=sync)
        self.sampler = SimpleNamespace(next_batch=self._next_batch)

    def _next_batch(self):
        self.next_prompt += 2
        return [self.next_prompt - 2, self.next_prompt - 1]

    def sample_batch(self, indices, iteration, generate):
        gens, stats = generate([[i + 5] for i in indices], SimpleNamespace(n=2))
        return pd.DataFrame({"prompt": [g.prompt_index for g in gens]}), {**stats, "first_prompt": float(indices[0])}

    def account_rollout(self, iteration, num_prompts, stats):
        pass

    def train(self, batch):
        t = self.counters.iteration + 1
        self.during_train(t)
        self.counters.iteration, self.counters.step = t, self.counters.step + 1
        return {"loss": 0.0, "mismatch/mismatch_kl": self.mismatch_kl(t)}


def _run(k: int, iterations: int, session=None, engine=None):
    engine = engine or Engine()
    session = session or Session(k, iterations, engine)
    rows, ahead = [], []
    with AsyncLoop(session, None, last_iteration=iterations, log=lambda m: None) as pipe:
        for _ in range(iterations):
            rows.append(pipe.step())
            ahead.append([b.iteration for b in pipe.ready])
    return rows, ahead, session, engine


@pytest.mark.parametrize("k", [1, 2])
def test_staleness_from_logged_versions_is_the_schedule_and_at_most_k(k):
    rows, ahead, session, engine = _run(k, 7)
    version_after = {0: 0.0} | {int(r["iteration"]): r["optimizer_step"] for r in rows}
    for r in rows:
        t = int(r["iteration"])
        assert r["engine/weight_version"] == version_after[max(0, t - 1 - k)], t  # from logged values only
        assert r["staleness"] == min(k, t - 1) <= k
    # the prompts go in order, each batch once: batch t holds prompts 2(t-1), 2(t-1)+1
    assert [r["first_prompt"] for r in rows] == [2.0 * (t - 1) for t in range(1, 8)]
    # at most k batches wait for the trainer, and none beyond the last iteration is sampled
    assert all(len(a) <= k for a in ahead) and ahead[-1] == []
    # every batch was sampled on the producer thread, every publish happened on this (the driver's) thread
    assert {name for _, name in engine.batches} == {"rollout-producer"}
    assert set(session.publish_threads) == {threading.current_thread().name}
    # one sync per version a batch needs: the base weights, then after each iteration up to 7 - 1 - k
    assert engine.loads == list(range(0, 7 - k))


@pytest.mark.parametrize(("kl", "warnings"), [(0.01, 0), (0.2, 1)])
def test_the_loop_logs_one_drift_warning_when_the_gap_stays_large(kl, warnings):
    engine = Engine()
    session = Session(1, 14, engine)
    session.mismatch_kl = lambda t: 0.0 if t == 1 else kl  # batch 1 is on-policy
    logged: list[str] = []
    with AsyncLoop(session, None, last_iteration=14, log=logged.append) as pipe:
        for _ in range(14):
            pipe.step()
    drift = [m for m in logged if "mismatch/mismatch_kl averaged" in m]
    assert len(drift) == warnings
    if warnings:  # the first full 10-iteration window (0 and nine 0.2s: mean 0.18) ends at iteration 10
        assert drift[0].startswith("warning: iteration 10: mismatch/mismatch_kl averaged 0.180")


def test_the_next_batch_is_sampled_while_the_trainer_trains():
    """Each side waits for the other: train t needs batch t+1 to be in flight, batch t+1 needs train t to have
    started. A synchronous loop would time out here."""
    engine = Engine()
    session = Session(1, 5, engine)
    training = {t: threading.Event() for t in range(1, 7)}
    sampling = {t: threading.Event() for t in range(1, 8)}
    produced = iter(range(1, 8))

    def before_batch():
        j = next(produced)
        sampling[j].set()
        if j >= 3:  # batch j is sampled while iteration j - 1 trains
            assert training[j - 1].wait(WAIT), f"batch {j} was not sampled during iteration {j - 1}'s training"

    def during_train(t):
        training[t].set()
        if t + 1 <= 5:
            assert sampling[t + 1].wait(WAIT), f"iteration {t} trained while nothing was being sampled"

    engine.before_batch, session.during_train = before_batch, during_train
    rows, _, _, _ = _run(1, 5, session, engine)
    assert len(rows) == 5


def test_new_weights_are_published_while_the_batch_in_flight_samples_the_old_ones():
    """Batch j (j >= 3) waits, mid-flight, until the driver has published the weights after iteration j - 1: only a
    publish staged ahead of the batch's end gets there; the load still waits for the batch (Engine asserts it)."""
    engine = Engine()
    session = Session(1, 5, engine)
    published = {v: threading.Event() for v in range(0, 8)}
    sync = session.rollout_source.sync
    inner = sync.publish

    def publish(version):
        out = inner(version)
        published[version].set()
        return out

    sync.publish, sync.publish_ahead = publish, True
    produced = iter(range(1, 8))

    def before_batch():
        j = next(produced)
        if 3 <= j <= 4:  # sampled from version j - 2 while the driver publishes version j - 1 (5 is the last batch:
            # nothing samples from version 4, so it is not synced)
            assert published[j - 1].wait(WAIT), f"version {j - 1} was not published while batch {j} was sampled"

    engine.before_batch = before_batch
    rows, _, _, _ = _run(1, 5, session, engine)
    assert engine.loads == [0, 1, 2, 3]  # each version loaded once, after its batch-in-flight ended
    assert all(r["engine/staged_publish_time_s"] > 0 for r in rows[:3])
    assert all(r["engine/sync_blocking_time_s"] < r["engine/sync_time_s"] for r in rows[:3])


def test_a_producer_error_reaches_the_driver():
    engine = Engine()

    def fail():
        if len(engine.batches) == 2:
            raise RolloutServerError("HTTP 400 from the server")

    engine.before_batch = fail
    with pytest.raises(RolloutServerError, match="HTTP 400"):
        _run(1, 6, engine=engine)


def test_config_requires_a_synced_server_and_rollout_is():
    with pytest.raises(ConfigError, match="max_staleness=1 needs a synced server engine.*hf engine"):
        load_config(overrides={"rollout.max_staleness": 1})
    with pytest.raises(ConfigError, match="never synced"):
        load_config(overrides={"rollout.max_staleness": 1, "rollout.engine": "openai", "rollout.server_url": "http://x",
                               "algo.rollout_is.enabled": True})  # fmt: skip
    with pytest.raises(ConfigError, match="algo.rollout_is.enabled=true"):
        load_config(overrides={"rollout.max_staleness": 1, "rollout.engine": "vllm"})
    cfg = load_config(overrides={"rollout.max_staleness": 1, "rollout.engine": "vllm", "algo.rollout_is.enabled": True})
    assert cfg.rollout.max_staleness == 1 and load_config().rollout.max_staleness == 0


def test_a_driver_failure_finishes_the_batch_in_flight_and_samples_no_more():
    engine = Engine()
    session = Session(2, 6, engine)  # k=2: batches 1, 2 and 3 are permitted at once
    failed = threading.Event()

    def before_batch():
        if len(engine.batches) == 1:  # batch 2 is in flight when the driver fails
            assert failed.wait(WAIT)
            time.sleep(0.2)

    def during_train(t):
        failed.set()
        raise RuntimeError("trainer died")

    engine.before_batch, session.during_train = before_batch, during_train
    with pytest.raises(RuntimeError, match="trainer died"):
        _run(2, 6, session, engine)
    assert len(engine.batches) == 2  # batch 2 finished (no half batch), batch 3 never started


def _checkpoint_with_pending(tmp_path, iteration: int, entries: list[tuple[int, int]]) -> str:
    """A train_state.json + pending parquet files as `AsyncLoop._save_pending` writes them."""
    from rlpipe.loop_async import PENDING_DIR, PENDING_KEY
    from rlpipe.rollout.batch import ROLLOUT_SCHEMA, write_batch
    from rlpipe.train.checkpoint import Counters, TrainState, write_train_state

    # empty, as when every group is filtered out (rollout.filter_uniform_groups): it must still round-trip
    frame = pd.DataFrame({c: [] for c in ROLLOUT_SCHEMA.names}, columns=ROLLOUT_SCHEMA.names)
    (tmp_path / PENDING_DIR).mkdir()
    meta = []
    for j, s in entries:
        rel = f"{PENDING_DIR}/iteration-{j:08d}.parquet"
        write_batch(frame, tmp_path / rel)
        meta.append({"iteration": j, "weights_iteration": s, "weight_version": s, "num_prompts": 2,
                     "stats": {"reward_mean": 0.5}, "file": rel})  # fmt: skip
    write_train_state(
        tmp_path, TrainState(counters=Counters(step=iteration, iteration=iteration), extra={PENDING_KEY: meta})
    )
    return str(tmp_path)


def test_pending_batches_are_checked_against_the_resumed_runs_k(tmp_path):
    from rlpipe.loop_async import load_pending, refuse_pending
    from rlpipe.rollout.batch import ROLLOUT_SCHEMA

    ck = _checkpoint_with_pending(tmp_path, 3, [(4, 1), (5, 2)])  # a k=2 run's checkpoint after iteration 3
    got = load_pending(ck, origin=3, k=2)
    assert [(b.iteration, b.weights_iteration, b.stats) for b in got] == [(4, 1, {"reward_mean": 0.5}),
                                                                         (5, 2, {"reward_mean": 0.5})]  # fmt: skip
    assert len(got[0].batch) == 0 and list(got[0].batch.columns) == ROLLOUT_SCHEMA.names
    with pytest.raises(ConfigError, match="rollout.max_staleness >= 2"):
        load_pending(ck, origin=3, k=1)  # batch 4 would be trained 2 updates after its weights
    with pytest.raises(ConfigError, match="holds 2 rollout batch"):
        refuse_pending(ck)  # the synchronous loop would skip prompts 4 and 5
    refuse_pending(None)
    refuse_pending(str(tmp_path / "missing"))  # not a checkpoint: the session reports it with its own checks
