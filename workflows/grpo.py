"""GRPO-family RL post-training as Flyte workflows.

`grpo` (default, fast): chains `rl_segment` tasks, each running `segment_size` iterations in one Ray job with the
weights resident. `grpo_granular`: rollout -> logprobs -> train (-> sft when due, -> evaluate when due) as separate
tasks per iteration; every batch and checkpoint is a typed output (cacheable, inspectable). Both call the same
`rlpipe.phases` / `rlpipe.loop` in the same order, so the same config and seed give the same numbers.

    pyflyte run workflows/grpo.py grpo                       # built-in task, tiny default model, local Ray, CPU
    pyflyte run workflows/grpo.py grpo --overrides '["iterations=4", "train.world_size=1"]'
    pyflyte run workflows/grpo.py grpo_granular --config_file my.yaml
    pyflyte run workflows/grpo.py grpo --engine vllm          # rollouts from a managed vLLM server (setup_vllm.sh)
"""

from __future__ import annotations

import json
from typing import NamedTuple

from flytekit import dynamic, workflow
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from images.specs import image_spec
from rlpipe.schedule import Schedule
from tasks.common import decode_config
from tasks.phases import (
    base_model,
    compute_logprobs,
    evaluate,
    metrics_table,
    resolve_config,
    rollout,
    sft,
    start_point,
    train,
)
from tasks.segment import rl_segment
from tasks.types import Checkpoint, MetricsTable


class RunOut(NamedTuple):
    checkpoint: Checkpoint | None
    metrics: MetricsTable


def _plan(config: str, start: Checkpoint | None, more_iterations: int) -> tuple[str, int, int]:
    """(config to run with, first iteration to run, last iteration): `more_iterations` > 0 extends the run past
    the start checkpoint (nightly retraining), else the run goes up to the config's `iterations`."""
    cfg = decode_config(config)
    done = start.iteration if start is not None else 0
    if more_iterations > 0:
        cfg.iterations = done + more_iterations
        config = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    return config, done + 1, cfg.iterations


@dynamic(container_image=image_spec("cpu"))
def segments(config: str, model: FlyteDirectory, start: Checkpoint | None, more_iterations: int = 0) -> RunOut:
    """Chain `rl_segment` tasks of `segment_size` iterations until the last iteration (`Schedule.segments`, as
    `rlpipe run` does)."""
    config, first, _ = _plan(config, start, more_iterations)
    ckpt, tables = start, []
    for _, k in Schedule(decode_config(config)).segments(first - 1):
        out = rl_segment(config=config, base_model=model, checkpoint=ckpt, k=k)
        ckpt = out.checkpoint
        tables.append(out.metrics)
    return RunOut(checkpoint=ckpt, metrics=metrics_table(config=config, tables=tables))


@dynamic(container_image=image_spec("cpu"))
def granular(config: str, model: FlyteDirectory, start: Checkpoint | None, more_iterations: int = 0) -> RunOut:
    """rollout -> compute_logprobs -> train (-> sft, -> evaluate when due) for each iteration."""
    config, first, last = _plan(config, start, more_iterations)
    schedule = Schedule(decode_config(config))
    ckpt, rows = start, []
    for it in range(first, last + 1):
        ro = rollout(config=config, base_model=model, checkpoint=ckpt, iteration=it)
        batch = compute_logprobs(config=config, base_model=model, checkpoint=ckpt, batch=ro.batch, iteration=it)
        tr = train(config=config, base_model=model, checkpoint=ckpt, batch=batch, iteration=it,
                   rollout_metrics=ro.metrics)  # fmt: skip
        ckpt = tr.checkpoint
        rows.append(tr.metrics)
        if schedule.sft_due(it):
            st = sft(config=config, base_model=model, checkpoint=ckpt, iteration=it)
            ckpt = st.checkpoint
            rows.append(st.metrics)
        if schedule.eval_due(it):
            rows.append(evaluate(config=config, base_model=model, checkpoint=ckpt, iteration=it))
    return RunOut(checkpoint=ckpt, metrics=metrics_table(config=config, rows=rows))


def _inputs(config_file, overrides, model_dir, checkpoint: str, resume: bool, engine: str) -> dict:
    """The validated config, the base model and the start checkpoint: the first three nodes of both workflows."""
    cfg = resolve_config(config_file=config_file, overrides=overrides, engine=engine)
    model = base_model(config=cfg, model_dir=model_dir)
    start = start_point(config=cfg, checkpoint=checkpoint, resume=resume)
    return {"config": cfg, "model": model, "start": start}


@workflow
def grpo(
    config_file: FlyteFile | None = None,
    overrides: list[str] | None = None,
    model_dir: FlyteDirectory | None = None,
    checkpoint: str = "",
    resume: bool = False,
    more_iterations: int = 0,
    engine: str = "",
) -> RunOut:
    """RL post-training, segment by segment (fast). With no inputs: the tiny default model on the built-in task.

    config_file: YAML PipelineConfig (None = defaults); overrides: `section.field=value` strings applied on top;
    model_dir: start from this HF model directory instead of `model.path`/the tiny default; checkpoint: start from
    this checkpoint (path or URI); resume: start from the newest complete checkpoint of the experiment under
    `checkpoint.root`; more_iterations: run this many iterations past the start (0 = up to `iterations`); engine:
    the rollout engine (hf, vllm, sglang, openai; "" = `rollout.engine` of the config).
    """
    return segments(
        **_inputs(config_file, overrides, model_dir, checkpoint, resume, engine), more_iterations=more_iterations
    )


@workflow
def grpo_granular(
    config_file: FlyteFile | None = None,
    overrides: list[str] | None = None,
    model_dir: FlyteDirectory | None = None,
    checkpoint: str = "",
    resume: bool = False,
    more_iterations: int = 0,
    engine: str = "",
) -> RunOut:
    """RL post-training with one task per phase per iteration (debugging, caching, lineage). Inputs as `grpo`."""
    return granular(
        **_inputs(config_file, overrides, model_dir, checkpoint, resume, engine), more_iterations=more_iterations
    )
