"""The phases one at a time (what the granular Flyte tasks of `tasks/phases.py` call): each opens a session from a
checkpoint (None = the base model), does one thing and, when it changed the weights, saves a new checkpoint.

They call the same `RLSession` methods in the same order as `rlpipe.loop`, so on the same seed they give the same
numbers. Granular phases are synchronous whatever `rollout.max_staleness` says (docs/FLYTE.md says why).
"""

from __future__ import annotations

import pandas as pd

from rlpipe.config import PipelineConfig
from rlpipe.errors import ConfigError
from rlpipe.loop import open_session
from rlpipe.session import RLSession


def rollout(cfg: PipelineConfig, checkpoint: str | None, iteration: int) -> tuple[pd.DataFrame, dict[str, float]]:
    """Sample and judge the next prompts with the checkpoint's policy (the checkpoint's sampler decides which)."""
    if cfg.rollout.max_staleness:
        print(f"rollout: the granular phases are synchronous; rollout.max_staleness={cfg.rollout.max_staleness} "
              "applies to the segment loop (rl_segment, rlpipe run)")  # fmt: skip
    session = open_session(cfg, checkpoint)
    try:
        _expect_iteration(session, iteration)
        return session.rollout()
    finally:
        session.close()


def compute_logprobs(cfg: PipelineConfig, checkpoint: str | None, batch: pd.DataFrame) -> pd.DataFrame:
    """Old-policy (and reference, when KL is on) logprobs as batch columns."""
    session = open_session(cfg, checkpoint)
    try:
        return session.compute_logprobs(batch)
    finally:
        session.close()


def train(
    cfg: PipelineConfig, checkpoint: str | None, batch: pd.DataFrame, iteration: int
) -> tuple[str, dict[str, float]]:
    """One RL update on `batch`; saves and returns the new checkpoint and the iteration's metrics."""
    session = open_session(cfg, checkpoint)
    try:
        _expect_iteration(session, iteration)
        session.account_external_rollout(iteration)
        metrics = session.train(batch)
        metrics["iteration"] = float(iteration)
        return session.save("train", metrics), metrics
    finally:
        session.close()


def sft(cfg: PipelineConfig, checkpoint: str, iteration: int) -> tuple[str, dict[str, float]]:
    """One SFT step (when due after `iteration`); saves and returns the new checkpoint."""
    session = open_session(cfg, checkpoint)
    try:
        metrics = session.sft()
        metrics["iteration"] = float(iteration)
        return session.save("sft", metrics), metrics
    finally:
        session.close()


def evaluate(cfg: PipelineConfig, checkpoint: str | None) -> dict[str, float]:
    """Greedy reward on the held-out prompts."""
    session = open_session(cfg, checkpoint)
    try:
        return session.evaluate()
    finally:
        session.close()


def export_hf(cfg: PipelineConfig, checkpoint: str, out_dir: str) -> str:
    """Safetensors + tokenizer in HF layout, loadable by AutoModelForCausalLM / vLLM / SGLang."""
    session = open_session(cfg, checkpoint)
    try:
        session.controller.save_hf(out_dir)
        session.tokenizer.save_pretrained(out_dir)
        return out_dir
    finally:
        session.close()


def _expect_iteration(session: RLSession, iteration: int) -> None:
    expected = session.counters.iteration + 1
    if iteration != expected:
        raise ConfigError(f"iteration {iteration} requested but the checkpoint is at iteration {expected - 1}")
