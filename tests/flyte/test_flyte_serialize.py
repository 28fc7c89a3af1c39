"""The workflows compile for a remote cluster, offline: `pyflyte package` and `pyflyte register --dry-run`.

Asserts what the cluster will receive: the RayJob spec (CPU-only head with num-cpus 0, one worker group with
requests == limits from images.deploy; for RLPIPE_DEPLOY_KIND=gpu the trainer and the rollout-engine group, shutdown after the job with a TTL), retries/timeouts/caching, Artifact
partitions on the outputs, the ImageSpec names, and the nightly cron with its skip-overlap concurrency policy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from google.protobuf.json_format import MessageToDict

REPO = Path(__file__).resolve().parents[2]
PYFLYTE = str(Path(sys.executable).with_name("pyflyte"))


def _env(tmp: Path, kind: str | None = None) -> dict[str, str]:
    """A clean environment; `kind` sets RLPIPE_DEPLOY_KIND (None: the default, cpu)."""
    env = dict(os.environ, HOME=str(tmp / "home"), RAY_AUTH_MODE="disabled", FLYTE_IMG_FAST_FAIL="false")
    env.pop("RLPIPE_IMAGE_REGISTRY", None)
    env.pop("RLPIPE_DEPLOY_KIND", None)
    if kind is not None:
        env["RLPIPE_DEPLOY_KIND"] = kind
    return env


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> dict[str, dict]:
    """`pyflyte package` of the workflows; returns {entity file stem: the parsed proto as a dict}."""
    return _package(tmp_path_factory.mktemp("pkg"), None)


@pytest.fixture(scope="module")
def gpu_package(tmp_path_factory) -> dict[str, dict]:
    """The same, registered for the GPU deployment (RLPIPE_DEPLOY_KIND=gpu)."""
    return _package(tmp_path_factory.mktemp("pkg-gpu"), "gpu")


def _package(tmp: Path, kind: str | None) -> dict[str, dict]:
    from flyteidl.admin import launch_plan_pb2, task_pb2, workflow_pb2

    out = tmp / "flyte-package.tgz"
    proc = subprocess.run(
        [PYFLYTE, "--pkgs", "workflows", "package", "-o", str(out), "--force"],
        cwd=REPO, env=_env(tmp, kind), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entities = {}
    with tarfile.open(out) as tar:
        for member in tar.getmembers():
            if not member.name.endswith(".pb"):
                continue
            raw = tar.extractfile(member).read()
            stem = Path(member.name).stem.split("_", 1)[1]  # "03_tasks.phases.rollout_1" -> "tasks.phases.rollout_1"
            kind = stem.rsplit("_", 1)[1]
            msg = {"1": task_pb2.TaskSpec, "2": workflow_pb2.WorkflowSpec, "3": launch_plan_pb2.LaunchPlan}[kind]()
            msg.ParseFromString(raw)
            entities[stem] = MessageToDict(msg)
    return entities


def _task(package, name: str) -> dict:
    return package[f"{name}_1"]["template"]


def test_package_contains_every_task_workflow_and_launch_plan(package):
    names = set(package)
    for t in ("resolve_config", "base_model", "start_point", "rollout", "compute_logprobs", "train", "sft",
              "evaluate", "export_hf", "metrics_table"):  # fmt: skip
        assert f"tasks.phases.{t}_1" in names
    assert "tasks.segment.rl_segment_1" in names
    assert {"workflows.grpo.grpo_2", "workflows.grpo.grpo_granular_2", "grpo_nightly_3", "grpo_default_3"} <= names


@pytest.mark.parametrize("name", ["tasks.segment.rl_segment", "tasks.phases.train", "tasks.phases.rollout"])
def test_ray_job_spec(package, name):
    from images.deploy import CPU_WORKER, HEAD_RESOURCES

    template = _task(package, name)
    assert template["type"] == "ray"
    job = template["custom"]
    assert job["shutdownAfterJobFinishes"] is True
    assert job["ttlSecondsAfterFinished"] == 3600
    head = job["rayCluster"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    (head_container,) = head["k8sPod"]["podSpec"]["containers"]
    assert head_container["name"] == "ray-head"
    want_head = {"cpu": HEAD_RESOURCES.cpu, "memory": HEAD_RESOURCES.memory}
    assert head_container["resources"] == {"requests": want_head, "limits": want_head}
    (group,) = job["rayCluster"]["workerGroupSpec"]
    assert group["groupName"] == "cpu-workers"
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == CPU_WORKER.replicas
    (worker_container,) = group["k8sPod"]["podSpec"]["containers"]
    assert worker_container["name"] == "ray-worker"
    want = {"cpu": CPU_WORKER.cpu, "memory": CPU_WORKER.memory}
    assert worker_container["resources"] == {"requests": want, "limits": want}


def test_gpu_segment_job_has_the_trainer_and_the_rollout_group(gpu_package):
    """The GPU RayJob of the segment task: the trainer group and, beside it, the rollout-engine group, each with its
    GPU, its fixed size and the custom Ray resource that rlpipe's placement asks for (images/deploy.py)."""
    from images.deploy import GPU_IMAGE, PROFILES

    template = _task(gpu_package, "tasks.segment.rl_segment")
    assert template["container"]["image"] == GPU_IMAGE
    groups = template["custom"]["rayCluster"]["workerGroupSpec"]
    want = PROFILES["gpu"].worker_groups()
    assert [g["groupName"] for g in groups] == [name for name, _ in want] == ["gpu-workers", "rollout-workers"]
    for group, (name, shape) in zip(groups, want, strict=True):
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == shape.replicas, name
        assert group["rayStartParams"] == shape.ray_start_params(), name
        (container,) = group["k8sPod"]["podSpec"]["containers"]
        assert container["resources"] == {"requests": shape.k8s_resources(), "limits": shape.k8s_resources()}, name
    assert json.loads(groups[1]["rayStartParams"]["resources"][1:-1].replace('\\"', '"')) == {"rollout_engine": 1}


def test_retries_timeouts_cache_and_decks(package):
    seg = _task(package, "tasks.segment.rl_segment")["metadata"]
    assert seg["retries"]["retries"] == 3 and seg["timeout"] == "21600s" and seg["generatesDeck"] is True
    train = _task(package, "tasks.phases.train")["metadata"]
    assert train["retries"]["retries"] == 2 and train["generatesDeck"] is True and not train.get("discoverable")
    for cached in ("tasks.phases.rollout", "tasks.phases.compute_logprobs"):
        meta = _task(package, cached)["metadata"]
        assert meta["discoverable"] is True and meta["discoveryVersion"] == "rlpipe-0.2"
    assert not _task(package, "tasks.phases.export_hf")["metadata"].get("discoverable")  # a local temp dir output


def test_images_are_the_deployment_images(package):
    from images.deploy import CPU_IMAGE

    for stem, entity in package.items():
        if stem.endswith("_1"):
            assert entity["template"]["container"]["image"] == CPU_IMAGE, stem


def test_outputs_carry_artifact_partitions(package):
    outputs = _task(package, "tasks.segment.rl_segment")["interface"]["outputs"]["variables"]
    art = outputs["checkpoint"]["artifactPartialId"]
    assert art["artifactKey"]["name"] == "rlpipe_checkpoint"
    assert set(art["partitions"]["value"]) == {"experiment", "step"}
    batch = _task(package, "tasks.phases.rollout")["interface"]["outputs"]["variables"]["batch"]
    assert batch["artifactPartialId"]["artifactKey"]["name"] == "rlpipe_rollout_batch"
    columns = {c["name"] for c in batch["type"]["structuredDatasetType"]["columns"]}
    assert {"prompt_ids", "response_ids", "rollout_logprobs", "reward", "advantage", "group_id"} <= columns
    assert batch["type"]["structuredDatasetType"]["format"] == "parquet"


def test_nightly_cron_skips_overlapping_runs_and_resumes(package):
    spec = package["grpo_nightly_3"]["spec"]
    assert spec["entityMetadata"]["schedule"]["cronSchedule"]["schedule"] == "0 2 * * *"
    assert spec["concurrencyPolicy"] == {"max": 1, "behavior": "CONCURRENCY_LIMIT_BEHAVIOR_SKIP"}
    fixed = spec["fixedInputs"]["literals"]
    assert fixed["resume"]["scalar"]["primitive"]["boolean"] is True
    defaults = spec["defaultInputs"]["parameters"]
    overrides = [lit["scalar"]["primitive"]["stringValue"]
                 for lit in defaults["overrides"]["default"]["scalar"]["union"]["value"]["collection"]["literals"]]  # fmt: skip
    assert any(o.startswith("checkpoint.root=") for o in overrides)
    assert defaults["more_iterations"]["default"]["scalar"]["primitive"]["integer"] == "10"
    assert "schedule" not in package["grpo_default_3"]["spec"].get("entityMetadata", {})


def test_register_dry_run_copy_none_works_offline(tmp_path):
    proc = subprocess.run(
        [PYFLYTE, "register", "--dry-run", "--copy", "none", "--version", "v0-test", "workflows"],
        cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    for name in ("tasks.segment.rl_segment", "workflows.grpo.grpo", "grpo_nightly"):
        assert name in text, text
