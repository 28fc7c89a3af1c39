"""The async RL loop (bounded staleness, one-step-off-policy): a producer thread samples ahead while the trainer
trains. The synchronous loop beside it is `rlpipe.loop`; both run through `rlpipe.loop.segment_loop`.

`rollout.max_staleness = k >= 1`. The schedule is fixed, so a run is reproducible and a resumed run equals an
uninterrupted one:

* batch `j` (the batch RL iteration `j` trains) is sampled from the weights after iteration
  `s(j) = max(origin, j - 1 - k)`, where `origin` is the iteration the session started at; it is trained on the
  weights after iteration `j - 1`, so its staleness `(j - 1) - s(j)` is at most k (exactly k in steady state).
  `staleness` and `engine/weight_version` are logged per iteration and checked here before every update;
* while the trainer trains batch `j`, the producer samples batch `j + k` (from the weights after `j - 1`);
* after the update the driver publishes the new weights while the producer is still sampling (`EngineSync.stage`:
  a new directory, not the served one); once every batch that needs older weights has been sampled, it loads and
  probes them (`EngineSync.ensure_current`) under the engine lock, so no weight change lands inside a batch;
  the producer only samples (`EngineSync.generate_served`) and never calls the training workers;
* old logprobs are recomputed by the actor on the current weights (as in the synchronous loop); the engine's
  rollout logprobs stay in the batch, so rollout IS (required by config validation for k >= 1) corrects the gap.

Checkpoints: the batches sampled ahead (iterations `t+1 .. t+k` at a checkpoint after `t`) are written into the
checkpoint (`pending_rollouts/*.parquet` + their metadata in train_state.json `extra`), and the prompt sampler's
state is the producer's (after them). A resume trains those batches first and samples the next from the
checkpoint's weights, exactly as the uninterrupted run does: same prompts, same batches, same counters.

Throughput: one engine, one trainer; steady state costs max(sample, train + publish) + load + probe per iteration
instead of sample + train + publish + load + probe. k >= 2 buffers more batches (it absorbs jitter) but is no
faster in steady state.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from rlpipe.errors import CheckpointError, ConfigError
from rlpipe.rollout.batch import read_batch, write_batch
from rlpipe.rollout.engine_sync import SyncStats
from rlpipe.train import checkpoint as ckpt

PENDING_DIR = "pending_rollouts"
PENDING_KEY = "pending_rollouts"  # train_state.json `extra` key
# Rollout IS corrects a k-update-old batch only while one update moves the policy little. On the default task
# (bench/async_rollout.py, 400 iterations, k=1) the 10-iteration mean of mismatch/mismatch_kl peaked at 0.035 and
# 0.049 (two seeds) at lr 5e-4, where k=1 ended within the noise of k=0, and passed 0.05 by iteration 14 at lr 1e-3,
# where k=1 collapsed twice.
DRIFT_WINDOW = 10
DRIFT_WARN_KL = 0.05


def sampled_from(iteration: int, k: int, origin: int) -> int:
    """The iteration whose weights sample batch `iteration`: `max(origin, iteration - 1 - k)`."""
    return max(origin, iteration - 1 - k)


def check_staleness(iteration: int, weights_iteration: int, k: int) -> int:
    """Staleness of a batch trained at `iteration` (in updates); raises if it is outside [0, k]."""
    staleness = (iteration - 1) - weights_iteration
    if not 0 <= staleness <= k:
        raise RuntimeError(
            f"iteration {iteration} would train a batch sampled from the weights after iteration {weights_iteration} "
            f"(staleness {staleness}), outside [0, rollout.max_staleness={k}]"
        )
    return staleness


class DriftMonitor:
    """Warns once when the policy moves too far per update for rollout IS to correct a stale batch.

    Watches the running mean of `mismatch/mismatch_kl` (KL between the weights that sampled a batch and the weights
    that train it) over the last `window` iterations; a single spike does not warn, a sustained drift does.
    """

    def __init__(self, k: int, window: int = DRIFT_WINDOW, threshold: float = DRIFT_WARN_KL):
        self.k, self.window, self.threshold = k, window, threshold
        self.recent: deque[float] = deque(maxlen=window)
        self.warned = False

    def observe(self, iteration: int, mismatch_kl: float) -> str | None:
        """The warning text the first time the running mean passes the threshold; None otherwise."""
        self.recent.append(mismatch_kl)
        if self.warned or len(self.recent) < self.window:
            return None
        mean = sum(self.recent) / len(self.recent)
        if mean <= self.threshold:
            return None
        self.warned = True
        return (
            f"warning: iteration {iteration}: mismatch/mismatch_kl averaged {mean:.3f} over the last "
            f"{self.window} iterations (above {self.threshold}): each update moves the policy too far for rollout "
            f"IS to correct batches sampled {self.k} update(s) ago, and such runs learn worse than "
            "rollout.max_staleness=0 (bench/RESULTS.md, pipelined rollout). Lower train.lr or set "
            "rollout.max_staleness=0."
        )


@dataclass
class SampledBatch:
    """One rollout batch and the weights that sampled it."""

    iteration: int  # the RL iteration that trains it
    weights_iteration: int  # sampled from the weights after this iteration
    weight_version: int  # their version (the optimizer step), as the engine served it
    num_prompts: int
    batch: pd.DataFrame
    stats: dict[str, float]


@dataclass(frozen=True)
class _Permit:
    iteration: int
    weights_iteration: int
    weight_version: int


class RolloutProducer:
    """A thread that samples the batches the driver permits, in order; results (or its error) go to `out`."""

    def __init__(self, sample: Callable[[_Permit], SampledBatch]):
        self._sample = sample
        self._permits: queue.Queue[_Permit | None] = queue.Queue()
        self.out: queue.Queue[SampledBatch | BaseException] = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def permit(self, permit: _Permit) -> None:
        self._permits.put(permit)

    def _run(self) -> None:
        while (permit := self._permits.get()) is not None and not self._stopping.is_set():
            try:
                self.out.put(self._sample(permit))
            except BaseException as exc:  # handed to the driver, which raises it
                self.out.put(exc)
                return

    def take(self) -> SampledBatch:
        """The next batch; the producer's error if it failed."""
        while True:
            try:
                item = self.out.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the rollout producer thread stopped without a batch or an error") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def stop(self) -> None:
        """Finish the batch in flight (weights never change inside one), skip the permitted rest, end the thread."""
        self._stopping.set()
        self._permits.put(None)
        self._thread.join()


class AsyncLoop:
    """The async loop over one `RLSession` (weights resident): `step()` runs one RL iteration."""

    def __init__(self, session, checkpoint: str | None, last_iteration: int, log=print):
        self.session, self.log = session, log
        self.k = session.cfg.rollout.max_staleness
        self.sync = session.rollout_source.sync  # config validation admits k >= 1 only for synced engines
        self.origin = session.counters.iteration
        # the last batch to sample: this segment's, plus the k the next segment trains first (from the checkpoint)
        self.last = min(session.cfg.iterations, last_iteration + self.k)
        self.versions = {self.origin: session.counters.step}  # weights after iteration i -> their version
        self.ready: deque[SampledBatch] = deque(load_pending(checkpoint, self.origin, self.k) if checkpoint else [])
        self.permitted = self.origin + len(self.ready)
        self.sync.ensure_current(session.counters.step)  # the origin's weights, before the producer starts
        self.producer = RolloutProducer(self._sample)
        self.drift = DriftMonitor(self.k)
        session.run.save_hooks.append(self._save_pending)
        self._permit_through(self.origin + self.k + 1)

    # ------------------------------------------------------------------ producer side
    def _sample(self, permit: _Permit) -> SampledBatch:
        """Runs on the producer thread: draw the prompts, sample them from the synced engine, judge them."""
        indices = self.session.sampler.next_batch()

        def generate(prompts, params):
            gens, restarts = self.sync.generate_served(prompts, params, permit.weight_version)
            return gens, {"engine/weight_version": float(permit.weight_version), "engine/restarts": float(restarts)}

        batch, stats = self.session.sample_batch(indices, permit.iteration, generate)
        return SampledBatch(permit.iteration, permit.weights_iteration, permit.weight_version, len(indices),
                            batch, stats)  # fmt: skip

    # ------------------------------------------------------------------ driver side
    def _permit_through(self, iteration: int) -> None:
        """Let the producer sample every batch up to `iteration` (and `self.last`)."""
        while self.permitted < min(iteration, self.last):
            j = self.permitted + 1
            s = sampled_from(j, self.k, self.origin)
            self.producer.permit(_Permit(j, s, self.versions[s]))
            self.permitted = j

    def _pull_through(self, iteration: int) -> None:
        """Wait until every batch up to `iteration` is sampled."""
        while (self.ready[-1].iteration if self.ready else self.session.counters.iteration) < iteration:
            got = self.producer.take()
            expected = (self.ready[-1].iteration if self.ready else self.session.counters.iteration) + 1
            if got.iteration != expected:
                raise RuntimeError(f"rollout producer returned batch {got.iteration}, expected {expected}")
            self.ready.append(got)

    def step(self) -> dict[str, float]:
        """One RL iteration: train the batch sampled ahead while the producer samples the next; sync; eval."""
        s = self.session
        start = time.perf_counter()
        t = s.counters.iteration + 1
        self._permit_through(t + self.k)
        self._pull_through(t)
        waited = time.perf_counter() - start
        sampled = self.ready.popleft()
        staleness = check_staleness(t, sampled.weights_iteration, self.k)
        s.account_rollout(t, sampled.num_prompts, sampled.stats)
        row = dict(sampled.stats)
        row.update({"staleness": float(staleness), "staleness_optimizer_steps":
                    float(s.counters.step - sampled.weight_version),
                    "pipeline/weights_iteration": float(sampled.weights_iteration), "pipeline/wait_s": waited})  # fmt: skip
        row.update(s.train(sampled.batch))
        if (warning := self.drift.observe(t, row.get("mismatch/mismatch_kl", 0.0))) is not None:
            self.log(warning)
        if s.schedule.sft_due(t):
            row.update(s.sft())
        self.versions[t] = s.counters.step
        eval_due = s.schedule.eval_due(t)
        sync_due = t + 1 + self.k <= self.last or eval_due
        if sync_due:
            self.sync.stage(s.counters.step)  # publish while the producer still samples the served weights
        self._pull_through(min(t + self.k, self.last))  # every batch that needs older weights is sampled
        with self.sync.lock:  # the producer is idle here: it has no permit until the next step
            if sync_due:
                row.update(self._sync_now(s.counters.step))
            if eval_due:
                row.update(s.evaluate())
        row["iteration"] = float(t)
        row["optimizer_step"] = float(s.counters.step)
        row["iteration_time_s"] = time.perf_counter() - start
        return row

    def _sync_now(self, version: int) -> dict[str, float]:
        self.sync.stats = SyncStats()
        self.sync.ensure_current(version)
        return self.sync.stats.sync_metrics()

    # ------------------------------------------------------------------ checkpoints
    def _save_pending(self, tmp_dir: Path) -> dict:
        """Session save hook: write the batches sampled ahead of the trainer into the checkpoint."""
        if self.permitted != (self.ready[-1].iteration if self.ready else self.session.counters.iteration):
            raise CheckpointError("a checkpoint was requested while a rollout batch was being sampled")
        entries = []
        for b in self.ready:
            rel = f"{PENDING_DIR}/iteration-{b.iteration:08d}.parquet"
            (tmp_dir / PENDING_DIR).mkdir(exist_ok=True)
            write_batch(b.batch, tmp_dir / rel)
            entries.append({"iteration": b.iteration, "weights_iteration": b.weights_iteration,
                            "weight_version": b.weight_version, "num_prompts": b.num_prompts,
                            "stats": b.stats, "file": rel})  # fmt: skip
        return {PENDING_KEY: entries}

    def close(self) -> None:
        self.producer.stop()
        if self._save_pending in self.session.run.save_hooks:
            self.session.run.save_hooks.remove(self._save_pending)

    def __enter__(self) -> AsyncLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pending_entries(checkpoint: str) -> list[dict]:
    return list(ckpt.load_train_state(ckpt.local_path(checkpoint)).extra.get(PENDING_KEY, []))


def load_pending(checkpoint: str, origin: int, k: int) -> list[SampledBatch]:
    """The batches a checkpoint holds that were sampled ahead of its trainer, checked against this run's k."""
    out = []
    root = Path(ckpt.local_path(checkpoint))
    for n, e in enumerate(_pending_entries(checkpoint)):
        if e["iteration"] != origin + 1 + n:
            raise CheckpointError(f"{checkpoint}: pending rollout batch {n} is for iteration {e['iteration']}, "
                                  f"expected {origin + 1 + n}")  # fmt: skip
        if (e["iteration"] - 1) - e["weights_iteration"] > k:
            raise ConfigError(
                f"{checkpoint} holds rollout batches sampled with a larger rollout.max_staleness than {k}: "
                f"resume with rollout.max_staleness >= {(e['iteration'] - 1) - e['weights_iteration']}"
            )
        stats = {key: float(v) for key, v in e["stats"].items()}
        out.append(SampledBatch(e["iteration"], e["weights_iteration"], e["weight_version"], e["num_prompts"],
                                read_batch(root / e["file"]), stats))  # fmt: skip
    return out


def refuse_pending(checkpoint: str | None) -> None:
    """The synchronous loop cannot train batches sampled ahead; skipping them would skip their prompts."""
    if checkpoint is None:
        return
    try:
        pending = _pending_entries(checkpoint)
    except (CheckpointError, ConfigError, OSError):
        return  # not a readable checkpoint: opening the session reports that, with its own checks
    if pending:
        raise ConfigError(
            f"{checkpoint} holds {len(pending)} rollout batch(es) sampled ahead by a rollout.max_staleness >= "
            f"{len(pending)} run: resume it with rollout.max_staleness >= {len(pending)} in the segment loop "
            "(the synchronous loop would skip their prompts)"
        )
