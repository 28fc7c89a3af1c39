"""Shared pieces of the task modules: config decoding, task decorators per deployment kind, resume detection."""

from __future__ import annotations

import functools
import json
import os

from flytekit import Cache, ExecutionParameters, FlyteContextManager, task
from flytekit.core.task import TaskPlugins
from flytekit.deck import DeckField
from flytekit.types.directory import FlyteDirectory
from flytekitplugins.ray.task import RayFunctionTask

from images.specs import image_spec
from rlpipe.config import PipelineConfig, validate_config
from rlpipe.ray_env import ensure_ray, set_driver_env
from rlpipe.train.lineage import lineage_chain, read_manifest
from tasks import storage
from tasks.ray_config import RlpipeRayJobConfig, ray_job_config
from tasks.types import Checkpoint

DEPLOY_KIND = os.environ.get("RLPIPE_DEPLOY_KIND", "cpu")
"""Which RayJob shape and image the Ray tasks are registered with ('cpu' or 'gpu'); read at import."""

CACHE_VERSION = "rlpipe-0.2"
"""Bump when a cached phase's output for the same inputs changes (code change that alters numbers)."""

CACHE = Cache(version=CACHE_VERSION)


DECK_FIELDS = (DeckField.SOURCE_CODE, DeckField.TIMELINE, DeckField.INPUT, DeckField.OUTPUT)
"""Flyte's default decks minus Dependencies, which runs `pip list` in a subprocess at the end of every task (~0.6 s
per segment on 2 cores); the image spec already pins what the task ran with."""


class RlpipeRayTask(RayFunctionTask):
    """Flyte's Ray task, except that a local execution starts rlpipe's own Ray before the plugin's `ray.init()`.

    Locally the plugin starts a default Ray (dashboard on, ~2 s more, and without the worker environment rlpipe
    sets) that every later task of the run reuses; with ours already up, its `ray.init(ignore_reinit_error=True)` is
    a no-op. On a cluster nothing changes: the plugin connects to the RayJob's cluster.
    """

    def pre_execute(self, user_params: ExecutionParameters) -> ExecutionParameters:
        if FlyteContextManager.current_context().execution_state.is_local_execution():
            ensure_ray()
        return super().pre_execute(user_params)


TaskPlugins.register_pythontask_plugin(RlpipeRayJobConfig, RlpipeRayTask)


def ray_task(**kwargs):
    """`@task` with the deployment's RayJobConfig and image: head num-cpus 0, one worker group, auto shutdown."""
    kwargs.setdefault("deck_fields", DECK_FIELDS)
    return task(task_config=ray_job_config(DEPLOY_KIND), container_image=image_spec(DEPLOY_KIND), **kwargs)


def cpu_task(**kwargs):
    """`@task` for light phases (config, bookkeeping) that need no Ray cluster."""
    return task(container_image=image_spec("cpu"), **kwargs)


def decode_config(config: str) -> PipelineConfig:
    """The validated PipelineConfig from the JSON string the workflow passes between tasks."""
    return validate_config(json.loads(config), source="<workflow config>")


def engine_config(config: str, base_model: FlyteDirectory | None) -> tuple[PipelineConfig, PipelineConfig, str | None]:
    """(user config, working config with a local checkpoint root and the materialized base model, remote root)."""
    user = decode_config(config)
    work, remote = storage.working_config(user)
    if base_model is not None:
        work = work.model_copy(deep=True)
        work.model.path = str(base_model.download())
    return user, work, remote


def checkpoint_metrics_history(location: str, max_depth: int = 500) -> list[dict[str, float]]:
    """Metrics rows stored in the manifests along the lineage chain, oldest first (the curves of a granular run)."""
    try:
        chain = lineage_chain(location, max_depth=max_depth)
    except Exception:  # noqa: BLE001 - decks must never fail a task
        return []
    return [dict(e.manifest.metrics) for e in reversed(chain.entries) if e.manifest.metrics]


def resumable(user: PipelineConfig, start: Checkpoint | None, target_iteration: int) -> str | None:
    """A newer complete checkpoint of this chain under the root (left by a failed attempt of this task), or None.

    It must descend from `start` (so a stale run of the same experiment is never picked up) and not pass
    `target_iteration` (what this task was asked to reach).
    """
    latest = storage.latest_location(user)
    if latest is None or (start is not None and _same(latest, start.uri)):
        return None
    iteration = read_manifest(latest).iteration
    if iteration <= (start.iteration if start else 0) or iteration > target_iteration:
        return None
    return latest if storage.descends_from(latest, start.uri if start else None) else None


def _same(a: str, b: str) -> bool:
    return (a.rstrip("/") == b.rstrip("/")) if storage.is_uri(a) else os.path.realpath(a) == os.path.realpath(b)


@functools.cache
def env_defaults() -> None:
    """Environment a local Ray 2.60 and the tokenizers need (`rlpipe.ray_env.WORKER_ENV`; idempotent)."""
    set_driver_env()
