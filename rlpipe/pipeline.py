"""Phase functions: what the Flyte tasks and `rlpipe run` call.

Each granular phase opens a session from a checkpoint (None = the base model), does one thing and, when it changed
the weights, saves a new checkpoint. `run_segment` keeps one session (weights resident) for k iterations. Both
paths call the same `RLSession` methods in the same order, so on the same seed they give the same numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from rlpipe.base_model import prepare_base_model
from rlpipe.config import PipelineConfig
from rlpipe.session import RLSession

Log = Callable[[str], None]


@dataclass
class SegmentResult:
    """What one segment leaves behind: its last checkpoint and one metrics row per iteration."""

    checkpoint: str
    metrics: list[dict[str, float]] = field(default_factory=list)


def _open(cfg: PipelineConfig, checkpoint: str | None, log: Log = print, pipelined: bool = False) -> RLSession:
    """A session; only the pipelined segment loop may resume a checkpoint holding batches sampled ahead."""
    if not pipelined:
        from rlpipe.pipelined import refuse_pending

        refuse_pending(checkpoint)
    return RLSession(cfg, prepare_base_model(cfg, log), checkpoint, log)


def rollout(cfg: PipelineConfig, checkpoint: str | None, iteration: int) -> tuple[pd.DataFrame, dict[str, float]]:
    """Sample and judge the next prompts with the checkpoint's policy (the checkpoint's sampler decides which).

    Granular phases are synchronous whatever `rollout.max_staleness` says (docs/FLYTE.md says why)."""
    if cfg.rollout.max_staleness:
        print(f"rollout: the granular phases are synchronous; rollout.max_staleness={cfg.rollout.max_staleness} "
              "applies to the segment loop (rl_segment, rlpipe run)")  # fmt: skip
    session = _open(cfg, checkpoint)
    try:
        _expect_iteration(session, iteration)
        return session.rollout()
    finally:
        session.close()


def compute_logprobs(cfg: PipelineConfig, checkpoint: str | None, batch: pd.DataFrame) -> pd.DataFrame:
    """Old-policy (and reference, when KL is on) logprobs as batch columns."""
    session = _open(cfg, checkpoint)
    try:
        return session.compute_logprobs(batch)
    finally:
        session.close()


def train(
    cfg: PipelineConfig, checkpoint: str | None, batch: pd.DataFrame, iteration: int
) -> tuple[str, dict[str, float]]:
    """One RL update on `batch`; saves and returns the new checkpoint and the iteration's metrics."""
    session = _open(cfg, checkpoint)
    try:
        _expect_iteration(session, iteration)
        session.sampler.next_batch()  # the rollout phase consumed these prompts in its own session
        session.state.consumed_prompts += cfg.rollout.prompts_per_step
        session.state.data.append({"name": f"rollout@{iteration}", "path": "<rollout batch>", "sha256": None})
        metrics = session.train(batch)
        metrics["iteration"] = float(iteration)
        return session.save("train", metrics), metrics
    finally:
        session.close()


def sft(cfg: PipelineConfig, checkpoint: str, iteration: int) -> tuple[str, dict[str, float]]:
    """One SFT step (when due after `iteration`); saves and returns the new checkpoint."""
    session = _open(cfg, checkpoint)
    try:
        metrics = session.sft()
        metrics["iteration"] = float(iteration)
        return session.save("sft", metrics), metrics
    finally:
        session.close()


def evaluate(cfg: PipelineConfig, checkpoint: str | None) -> dict[str, float]:
    session = _open(cfg, checkpoint)
    try:
        return session.evaluate()
    finally:
        session.close()


def export_hf(cfg: PipelineConfig, checkpoint: str, out_dir: str) -> str:
    """Safetensors + tokenizer in HF layout, loadable by AutoModelForCausalLM / vLLM / SGLang."""
    session = _open(cfg, checkpoint)
    try:
        session.controller.save_hf(out_dir)
        session.tokenizer.save_pretrained(out_dir)
        return out_dir
    finally:
        session.close()


def iteration_step(session: RLSession, log: Log = print) -> dict[str, float]:
    """rollout -> (logprobs inside fit) -> train -> sft when due -> eval when due; one metrics row."""
    start = time.perf_counter()
    iteration = session.state.iteration + 1
    batch, row = session.rollout()
    row.update(session.train(batch))
    if session.sft_due(iteration):
        row.update(session.sft())
    if session.cfg.eval_every and iteration % session.cfg.eval_every == 0:
        row.update(session.evaluate())
    row["iteration"] = float(iteration)
    row["optimizer_step"] = float(session.state.optimizer_step)
    row["iteration_time_s"] = time.perf_counter() - start
    return row


def progress_line(row: dict[str, float], total: int) -> str:
    """One log line per reported iteration (task logs, pod logs): where the run is and whether reward rises."""

    def val(key: str, spec: str) -> str:
        return format(row[key], spec) if key in row else "n/a"

    return (
        f"iteration {int(row.get('iteration', 0))}/{total} reward {val('reward_mean', '.3f')} "
        f"pass@n {val('pass_at_n', '.3f')} loss {val('loss', '.4f')} entropy {val('rollout_entropy', '.3f')}"
    )


def run_segment(
    cfg: PipelineConfig,
    checkpoint: str | None,
    k: int,
    on_iteration: Callable[[dict[str, float]], None] | None = None,
    log: Log = print,
) -> SegmentResult:
    """k iterations with the weights resident, then one checkpoint (plus every `checkpoint.every` iterations).

    With `rollout.max_staleness >= 1` the iterations are pipelined (`rlpipe.pipelined`): sampling overlaps training.
    """
    pipelined = cfg.rollout.max_staleness > 0
    session = _open(cfg, checkpoint, log, pipelined=pipelined)
    try:
        n = max(0, min(k, cfg.iterations - session.state.iteration))
        if not pipelined:
            return _segment_loop(session, checkpoint, n, lambda: iteration_step(session, log), on_iteration)
        from rlpipe.pipelined import RolloutPipeline

        with RolloutPipeline(session, checkpoint, session.state.iteration + n, log) as pipe:
            return _segment_loop(session, checkpoint, n, pipe.step, on_iteration)
    finally:
        session.close()


def _segment_loop(
    session: RLSession,
    checkpoint: str | None,
    n: int,
    step: Callable[[], dict[str, float]],
    on_iteration: Callable[[dict[str, float]], None] | None,
) -> SegmentResult:
    """`n` calls of `step` (one iteration each) with the segment's checkpoints."""
    every = session.cfg.checkpoint.every
    rows: list[dict[str, float]] = []
    last, saved_at = checkpoint, session.state.iteration
    for _ in range(n):
        row = step()
        rows.append(row)
        if on_iteration is not None:
            on_iteration(row)
        if every and session.state.iteration % every == 0:
            last, saved_at = session.save("segment", row), session.state.iteration
    if last is None or saved_at != session.state.iteration:
        last = session.save("segment", rows[-1] if rows else None)
    return SegmentResult(checkpoint=last, metrics=rows)


def _expect_iteration(session: RLSession, iteration: int) -> None:
    expected = session.state.iteration + 1
    if iteration != expected:
        from rlpipe.errors import ConfigError

        raise ConfigError(f"iteration {iteration} requested but the checkpoint is at iteration {expected - 1}")
