"""End-to-end local runs of both workflows (local Ray, CPU) and a retry that resumes from the last checkpoint."""

from __future__ import annotations

import math

import pytest
from flytekit import workflow
from flytekit.types.directory import FlyteDirectory

from tasks.segment import rl_segment
from tasks.types import Checkpoint

from ..conftest import tiny_overrides

pytestmark = pytest.mark.e2e

COMPARED = ("reward_mean", "reward_std", "loss", "policy_loss", "grad_norm", "train_entropy", "rollout_entropy",
            "clip_frac_low", "clip_frac_high", "tokens", "lr")  # fmt: skip


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    """Own HOME (Flyte's local cache lives in ~/.flyte) and a local Ray without auth."""
    from flytekit.core.local_cache import LocalTaskCache

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.chdir(tmp_path)
    LocalTaskCache._initialized = False
    yield
    LocalTaskCache._initialized = False


def _overrides(tmp_path, name: str, **extra) -> list[str]:
    """The shared tiny test config (tests/conftest.py) as `key=value` workflow overrides, two iterations."""
    base = tiny_overrides(tmp_path, **{"experiment": name, "iterations": 2, "segment_size": 2, **extra})
    return [f"{k}={v}" for k, v in base.items()]


def _rows(table) -> dict[int, dict[str, float]]:
    import pandas as pd

    frame = table.open(pd.DataFrame).all()
    return {int(r["iteration"]): r for r in frame.to_dict("records")}


def test_segment_and_granular_workflows_give_the_same_numbers(tmp_path):
    from workflows.grpo import grpo, grpo_granular

    seg = grpo(overrides=_overrides(tmp_path, "seg"))
    gran = grpo_granular(overrides=_overrides(tmp_path, "gran"))
    assert seg.checkpoint.iteration == gran.checkpoint.iteration == 2
    assert seg.checkpoint.step == gran.checkpoint.step
    a, b = _rows(seg.metrics), _rows(gran.metrics)
    assert sorted(a) == sorted(b) == [1, 2]
    for it in (1, 2):
        for key in COMPARED:
            if key in a[it] or key in b[it]:
                assert math.isclose(a[it][key], b[it][key], rel_tol=1e-5, abs_tol=1e-6), (
                    it,
                    key,
                    a[it][key],
                    b[it][key],
                )
    # lineage: the granular chain is base -> step 1 -> step 2, each checkpoint complete and in the root
    manifest = gran.checkpoint.manifest_dict()
    assert manifest["complete"] is True and manifest["parent"].endswith("gran/step-000001")
    assert gran.checkpoint.sampler.total_consumed == 8


@workflow
def one_segment(config: str, model: FlyteDirectory, k: int) -> Checkpoint:
    """rl_segment from the base model. (Calling the task bare fails in flytekit 1.16.31: it cannot convert an
    Annotated[dataclass, Artifact] output back to Python; inside a workflow the workflow's type is used.)"""
    return rl_segment(config=config, base_model=model, checkpoint=None, k=k).checkpoint


def test_segment_retry_after_lost_actor_resumes_from_last_checkpoint(tmp_path, monkeypatch):
    import ray.exceptions

    from rlpipe import loop
    from rlpipe.train.checkpoint import list_checkpoints
    from tasks.phases import base_model, resolve_config

    config = resolve_config(overrides=_overrides(tmp_path, "retry", iterations=3, **{"checkpoint.every": 1}))
    model = base_model(config=config)
    real_step, calls = loop.iteration_step, []

    def flaky_step(session, log=print):
        calls.append(session.counters.iteration + 1)
        if len(calls) == 3:  # the third iteration loses a worker, after iterations 1 and 2 were checkpointed
            raise ray.exceptions.ActorDiedError()
        return real_step(session, log)

    monkeypatch.setattr(loop, "iteration_step", flaky_step)
    with pytest.raises(Exception) as info:
        one_segment(config=config, model=model, k=3)
    chain, exc = [], info.value
    while exc is not None:
        chain.append(type(exc).__name__)
        exc = exc.__cause__ or exc.__context__
    assert "FlyteRecoverableException" in chain or "Recoverable" in str(info.value), chain
    assert [c.name for c in list_checkpoints(tmp_path / "ckpt", "retry")] == ["step-000001", "step-000002"]

    out = one_segment(config=config, model=model, k=3)  # what Flyte's retry runs
    assert calls == [1, 2, 3, 3]  # the retry ran only the missing iteration
    assert out.iteration == 3
    assert out.manifest_dict()["parent"].endswith("retry/step-000002")
    assert [c.name for c in list_checkpoints(tmp_path / "ckpt", "retry")][-1] == "step-000003"
