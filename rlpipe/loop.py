"""The RL loop: one iteration, a segment of iterations with its checkpoints, and the progress line.

    rollout -> (old/ref logprobs inside fit) -> train -> sft when due -> eval when due

`run_segment` keeps one `RLSession` (weights resident) for k iterations; with `rollout.max_staleness >= 1` the same
segment runs through `rlpipe.loop_async`, which overlaps sampling with training. `rlpipe.phases` runs the same
session methods one per call (the granular workflow), so both give the same numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rlpipe.base_model import prepare_base_model
from rlpipe.config import PipelineConfig
from rlpipe.session import RLSession

Log = Callable[[str], None]
OnIteration = Callable[[dict[str, float]], None]


@dataclass
class SegmentResult:
    """What one segment leaves behind: its last checkpoint and one metrics row per iteration."""

    checkpoint: str
    metrics: list[dict[str, float]] = field(default_factory=list)


def open_session(cfg: PipelineConfig, checkpoint: str | None, log: Log = print, pipelined: bool = False) -> RLSession:
    """A session; only the async loop may resume a checkpoint holding batches sampled ahead."""
    if not pipelined:
        from rlpipe.loop_async import refuse_pending

        refuse_pending(checkpoint)
    return RLSession(cfg, prepare_base_model(cfg, log), checkpoint, log)


def iteration_step(session: RLSession, log: Log = print) -> dict[str, float]:
    """One synchronous RL iteration; its metrics row."""
    start = time.perf_counter()
    iteration = session.counters.iteration + 1
    batch, row = session.rollout()
    row.update(session.train(batch))
    if session.schedule.sft_due(iteration):
        row.update(session.sft())
    if session.schedule.eval_due(iteration):
        row.update(session.evaluate())
    row["iteration"] = float(iteration)
    row["optimizer_step"] = float(session.counters.step)
    row["iteration_time_s"] = time.perf_counter() - start
    return row


def run_segment(
    cfg: PipelineConfig, checkpoint: str | None, k: int, on_iteration: OnIteration | None = None, log: Log = print
) -> SegmentResult:
    """k iterations (capped at `iterations`) with the weights resident, then one checkpoint (plus every
    `checkpoint.every` iterations)."""
    pipelined = cfg.rollout.max_staleness > 0
    session = open_session(cfg, checkpoint, log, pipelined=pipelined)
    try:
        n = max(0, min(k, cfg.iterations - session.counters.iteration))
        if not pipelined:
            return segment_loop(session, checkpoint, n, lambda: iteration_step(session, log), on_iteration)
        from rlpipe.loop_async import AsyncLoop

        with AsyncLoop(session, checkpoint, session.counters.iteration + n, log) as loop:
            return segment_loop(session, checkpoint, n, loop.step, on_iteration)
    finally:
        session.close()


def segment_loop(
    session: RLSession,
    checkpoint: str | None,
    n: int,
    step: Callable[[], dict[str, float]],
    on_iteration: OnIteration | None,
) -> SegmentResult:
    """`n` calls of `step` (one iteration each) with the segment's checkpoints."""
    rows: list[dict[str, float]] = []
    last, saved_at = checkpoint, session.counters.iteration
    for _ in range(n):
        row = step()
        rows.append(row)
        if on_iteration is not None:
            on_iteration(row)
        if session.schedule.checkpoint_due(session.counters.iteration):
            last, saved_at = session.save("segment", row), session.counters.iteration
    if last is None or saved_at != session.counters.iteration:
        last = session.save("segment", rows[-1] if rows else None)
    return SegmentResult(checkpoint=last, metrics=rows)


def progress_line(row: dict[str, float], total: int) -> str:
    """One log line per reported iteration (task logs, pod logs): where the run is and whether reward rises."""

    def val(key: str, spec: str) -> str:
        return format(row[key], spec) if key in row else "n/a"

    return (
        f"iteration {int(row.get('iteration', 0))}/{total} reward {val('reward_mean', '.3f')} "
        f"pass@n {val('pass_at_n', '.3f')} loss {val('loss', '.4f')} entropy {val('rollout_entropy', '.3f')}"
    )
