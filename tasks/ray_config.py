"""The RayJobConfig of every Ray task, built from the deployment constants in `images.deploy`.

One source of truth: the kustomize manifests under `k8s/` and these task configs read the same pod shapes, so a
Flyte-launched RayJob and a hand-applied one get the same head, workers and resources.

Shape of the job (KubeRay, via Flyte's Ray plugin):
- head: started with `num-cpus: 0` and `num-gpus: 0`, so the scheduler never puts a TrainingWorker on it (the head
  runs GCS, the dashboard and the task's driver process; it requests no GPU in either profile: a gpu=0 shape
  gives `Resources(gpu=None)`);
- the trainer worker group (`cpu-workers` or `gpu-workers`) with `replicas` pods, requests == limits (Guaranteed QoS);
  in the GPU profile its pods advertise the custom Ray resource `trainer` (grpo-gpu.yaml's `train.resources`), and a
  second group, `rollout-workers`, holds the rollout engines (GPU pods advertising `rollout_engine: 1`);
- `shutdown_after_job_finishes=True` plus a TTL, so a finished or failed job frees its GPUs but its pods stay long
  enough to read their logs.

Resources go through `HeadNodeConfig/WorkerNodeConfig(requests=, limits=)`: the plugin turns them into a pod spec for
the `ray-head` / `ray-worker` container, which serializes into the task's custom RayJob spec. (Flyte's Ray backend
only merges the container resources of such a pod spec; volumes like /dev/shm come from the plugin's default pod
template, see k8s/flyte/.)
"""

from __future__ import annotations

from dataclasses import dataclass

from flytekit import Resources
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig

from images.deploy import GPU_RESOURCE, RayGroupShape, profile

TTL_SECONDS_AFTER_FINISHED = 3600
"""Finished RayJobs (and their pods' logs) are kept one hour, then KubeRay deletes them."""

HEAD_START_PARAMS = {"num-cpus": "0", "num-gpus": "0", "include-dashboard": "true", "dashboard-host": "0.0.0.0"}
"""`ray start` flags of the head: no CPUs advertised (no actor lands on it); dashboard reachable in the pod network."""


def _resources(shape: RayGroupShape) -> Resources:
    """A Flyte Resources equal to the k8s `requests` (== `limits`) of a Ray group."""
    k8s = shape.k8s_resources()
    return Resources(cpu=k8s["cpu"], mem=k8s["memory"], gpu=k8s.get(GPU_RESOURCE))


def _worker_group(name: str, shape: RayGroupShape, replicas: int) -> WorkerNodeConfig:
    """A fixed-size worker group (no autoscaling) advertising the group's custom Ray resources."""
    res = _resources(shape)
    return WorkerNodeConfig(
        group_name=name,
        replicas=replicas,
        min_replicas=replicas,
        max_replicas=replicas,
        ray_start_params=shape.ray_start_params() or None,
        requests=res,
        limits=res,
    )


@dataclass
class RlpipeRayJobConfig(RayJobConfig):
    """The plugin's RayJob spec; its own type only so that `@task` builds a `tasks.common.RlpipeRayTask` for it."""


def ray_job_config(kind: str = "cpu", replicas: int | None = None) -> RlpipeRayJobConfig:
    """The RayJobConfig of the `kind` deployment ('cpu' or 'gpu'); `replicas` overrides the trainer group's count.

    Unknown kinds raise `rlpipe.errors.ConfigError` (from `images.deploy.profile`).
    """
    prof = profile(kind)
    head = _resources(prof.head)
    groups = [
        _worker_group(name, shape, replicas if replicas is not None and name == prof.worker_group else shape.replicas)
        for name, shape in prof.worker_groups()
    ]
    return RlpipeRayJobConfig(
        head_node_config=HeadNodeConfig(ray_start_params=dict(HEAD_START_PARAMS), requests=head, limits=head),
        worker_node_config=groups,
        shutdown_after_job_finishes=True,
        ttl_seconds_after_finished=TTL_SECONDS_AFTER_FINISHED,
    )
