"""The manifests, images/deploy.py, the Flyte tasks' RayJobConfig and the configs agree (image, resources, Ray
version, namespaces), and what an overlay runs fits its own ResourceQuota and LimitRange."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import shlex
import sys
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from k8s_objects import K8S, RAY_KINDS, REPO, all_pod_templates, cluster_spec, one, parse_quantity

import rlpipe
from images.deploy import GPU_RESOURCE, PROFILES, RAY_VERSION, RayGroupShape, profile
from rlpipe.errors import ConfigError

KINDS = sorted(PROFILES)


def _volume_at(podspec: dict, container: dict, mount_path: str) -> dict:
    name = next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == mount_path)
    return next(v for v in podspec["volumes"] if v["name"] == name)


def _assert_shape(podspec: dict, shape: RayGroupShape, container_name: str, where: str) -> None:
    container = podspec["containers"][0]
    assert container["name"] == container_name, where  # the names flytekitplugins-ray gives its containers
    assert container["resources"]["requests"] == shape.k8s_resources(), where
    assert container["resources"]["limits"] == shape.k8s_resources(), where
    shm = _volume_at(podspec, container, "/dev/shm")["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": shape.shm}, where
    # the object store (30% of memory by default) must fit in /dev/shm, and /dev/shm inside the memory limit
    assert parse_quantity(shape.memory) * Decimal("0.3") <= parse_quantity(shape.shm) < parse_quantity(shape.memory)


@pytest.mark.parametrize("kind", KINDS)
def test_ray_objects_match_deploy_profile(overlay, kind):
    prof = PROFILES[kind]
    objects = overlay(prof.overlay)
    ray_objects = [o for o in objects if o["kind"] in RAY_KINDS]
    assert len(ray_objects) == 2
    for obj in ray_objects:
        where = f"{prof.overlay} {obj['kind']}"
        spec = cluster_spec(obj)
        assert spec["rayVersion"] == RAY_VERSION, where
        assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0", where
        _assert_shape(spec["headGroupSpec"]["template"]["spec"], prof.head, "ray-head", where)
        groups = spec["workerGroupSpecs"]
        assert [g["groupName"] for g in groups] == [name for name, _ in prof.worker_groups()], where
        for group, (name, shape) in zip(groups, prof.worker_groups(), strict=True):
            _assert_group(group, shape, obj["kind"], f"{where} {name}")
    for role, template, _ in all_pod_templates(objects):
        for container in template["spec"]["containers"]:
            assert container["image"] == prof.image, f"{prof.overlay} {role}"


def _assert_group(group: dict, shape: RayGroupShape, kind: str, where: str) -> None:
    podspec = group["template"]["spec"]
    _assert_shape(podspec, shape, "ray-worker", where)
    if kind == "RayJob":
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == shape.replicas, where
    else:
        assert group["maxReplicas"] == shape.replicas, where
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], where
    assert group["rayStartParams"] == shape.ray_start_params(), where
    on_gpu_nodes = podspec.get("nodeSelector", {}).get("nvidia.com/gpu.present") == "true"
    tolerates = any(t.get("key") == GPU_RESOURCE for t in podspec.get("tolerations", []))
    assert on_gpu_nodes == tolerates == (shape.gpu > 0), where


def test_deploy_constants():
    assert RAY_VERSION == importlib.metadata.version("ray")
    assert f'"ray[default]=={RAY_VERSION}"' in (REPO / "pyproject.toml").read_text()
    assert PROFILES["cpu"].image.endswith(f":{rlpipe.__version__}")
    assert PROFILES["gpu"].image.endswith(f":{rlpipe.__version__}")
    assert PROFILES["cpu"].image != PROFILES["gpu"].image
    assert PROFILES["gpu"].worker.k8s_resources()[GPU_RESOURCE] == "1"
    assert GPU_RESOURCE not in PROFILES["cpu"].worker.k8s_resources()
    assert profile("gpu") is PROFILES["gpu"]
    with pytest.raises(ConfigError, match="unknown deployment kind 'tpu'"):
        profile("tpu")
    for name, prof in PROFILES.items():
        assert prof.kind == name and (K8S / "overlays" / prof.overlay / "kustomization.yaml").is_file()


def _sum(objects: list[dict], section: str, resource: str) -> Decimal:
    total = Decimal(0)
    for _, template, count in all_pod_templates(objects):
        for container in template["spec"]["containers"]:
            total += count * parse_quantity(container["resources"][section].get(resource, 0))
    return total


@pytest.mark.parametrize("kind", KINDS)
def test_one_rayjob_and_the_dev_cluster_at_full_size_fit_the_quota(overlay, kind):
    objects = overlay(PROFILES[kind].overlay)
    hard = one(objects, "ResourceQuota")["spec"]["hard"]
    for resource in ("cpu", "memory"):
        for section in ("requests", "limits"):
            assert _sum(objects, section, resource) <= parse_quantity(hard[f"{section}.{resource}"]), (
                section,
                resource,
            )
    gpus = _sum(objects, "requests", GPU_RESOURCE)
    assert gpus <= parse_quantity(hard[f"requests.{GPU_RESOURCE}"])
    assert (gpus > 0) == (PROFILES[kind].worker.gpu > 0)
    pods = sum(count for _, _, count in all_pod_templates(objects))
    assert pods <= int(hard["pods"])
    claims = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert len(claims) <= int(hard["persistentvolumeclaims"])
    storage = sum(parse_quantity(c["spec"]["resources"]["requests"]["storage"]) for c in claims)
    assert storage <= parse_quantity(hard["requests.storage"])


@pytest.mark.parametrize("kind", KINDS)
def test_containers_fit_the_limitrange(overlay, kind):
    objects = overlay(PROFILES[kind].overlay)
    (limits,) = [entry for entry in one(objects, "LimitRange")["spec"]["limits"] if entry["type"] == "Container"]
    for role, template, _ in all_pod_templates(objects):
        for container in template["spec"]["containers"]:
            for resource, value in container["resources"]["limits"].items():
                assert parse_quantity(value) <= parse_quantity(limits["max"][resource]), (role, resource)
            for resource, value in container["resources"]["requests"].items():
                if resource in limits["min"]:
                    assert parse_quantity(value) >= parse_quantity(limits["min"][resource]), (role, resource)


@pytest.mark.parametrize("kind", KINDS)
def test_rayjob_entrypoint_runs_a_mounted_config_sized_for_the_workers(overlay, kind):
    from rlpipe.cli import build_parser

    prof = PROFILES[kind]
    objects = overlay(prof.overlay)
    job = one(objects, "RayJob")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "rlpipe"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "run" and args.resume  # a retried or re-applied job continues, never clashes
    config_dir, config_name = str(Path(args.config).parent), Path(args.config).name
    head_spec = cluster_spec(job)["headGroupSpec"]["template"]["spec"]
    volume = _volume_at(head_spec, head_spec["containers"][0], config_dir)
    configmap = one(objects, "ConfigMap", volume["configMap"]["name"])
    cfg = yaml.safe_load(configmap["data"][config_name])
    world = cfg["train"]["world_size"]
    if prof.worker.gpu:
        assert cfg["train"]["device"] == "cuda"
        assert world == prof.worker.replicas * prof.worker.gpu  # one TrainingWorker (num_gpus=1) per GPU
    else:
        assert cfg["train"]["device"] == "cpu"
        assert world <= prof.worker.replicas * int(prof.worker.cpu)  # TrainingWorkers take 1 CPU each
    assert cfg["output_dir"].startswith("/data/") and cfg["checkpoint"]["root"].startswith("/data/")
    for container in head_spec["containers"]:
        assert "/data" in {m["mountPath"] for m in container["volumeMounts"]}


def test_kuberay_operator_values_match_crds_and_namespaces():
    values = yaml.safe_load((K8S / "kuberay-operator" / "values.yaml").read_text())
    assert values["image"]["tag"] == "v1.7.0"  # the version of ../shared/kuberay-crds
    assert sorted(values["watchNamespace"]) == sorted(p.namespace for p in PROFILES.values())
    readme = (K8S / "README.md").read_text()
    assert "--version 1.7.0" in readme and "kuberay-operator/values.yaml" in readme


FLYTE_RAY_KEYS = {  # plugins.ray settings of flyteplugins (FlytePropeller config reference)
    "dashboardHost",
    "dashboardURLTemplate",
    "defaults",
    "enableUsageStats",
    "includeDashboard",
    "logs",
    "logsSidecar",
    "remoteClusterConfig",
    "serviceType",
    "shutdownAfterJobFinishes",
    "ttlSecondsAfterFinished",
}


def _flyte_ray_task_type() -> str:
    """The task type flytekitplugins-ray registers, read from its source (importing it costs seconds)."""
    spec = importlib.util.find_spec("flytekitplugins")
    for location in spec.submodule_search_locations or []:
        source = Path(location) / "ray" / "task.py"
        if source.is_file():
            return re.search(r'_RAY_TASK_TYPE = "([^"]+)"', source.read_text()).group(1)
    raise AssertionError("flytekitplugins-ray is not installed")


def test_flyte_propeller_enables_the_ray_plugin(rendered):
    configmap = one(rendered["flyte"], "ConfigMap", "flyte-propeller-ray-plugin")
    assert configmap["metadata"]["namespace"] == "flyte"
    config = yaml.safe_load(configmap["data"]["ray.yaml"])
    plugins = config["tasks"]["task-plugins"]
    task_type = _flyte_ray_task_type()
    assert task_type == "ray"
    assert {"container", "sidecar", "k8s-array", "ray"} <= set(plugins["enabled-plugins"])
    assert plugins["default-for-task-types"][task_type] == "ray"
    assert plugins["default-for-task-types"]["container"] == "container"
    ray = config["plugins"]["ray"]
    assert set(ray) <= FLYTE_RAY_KEYS
    assert ray["shutdownAfterJobFinishes"] is True
    assert isinstance(ray["ttlSecondsAfterFinished"], int) and ray["ttlSecondsAfterFinished"] > 0
    assert ray["serviceType"] == "ClusterIP"


def _load_ray_job_config():
    if not (REPO / "tasks" / "ray_config.py").is_file():
        pytest.skip("tasks/ray_config.py not present yet: RayJobConfig consistency check skipped")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module("tasks.ray_config").ray_job_config


def _flyte_resources(resources) -> dict[str, str]:
    out = {"cpu": resources.cpu, "memory": resources.mem}
    if getattr(resources, "gpu", None) not in (None, 0, "0"):
        out[GPU_RESOURCE] = resources.gpu
    return {k: str(v) for k, v in out.items() if v is not None}


@pytest.mark.parametrize("kind", KINDS)
def test_tasks_ray_job_config_matches_deploy_profile(kind):
    ray_job_config = _load_ray_job_config()
    prof = PROFILES[kind]
    cfg = ray_job_config(kind)
    head = cfg.head_node_config
    assert head is not None
    for section in ("requests", "limits"):
        assert _flyte_resources(getattr(head, section)) == prof.head.k8s_resources(), ("head", section)
    groups = cfg.worker_node_config
    assert [g.group_name for g in groups] == [name for name, _ in prof.worker_groups()]  # gpu: trainers + rollout
    for worker, (name, shape) in zip(groups, prof.worker_groups(), strict=True):
        assert worker.replicas == worker.min_replicas == worker.max_replicas == shape.replicas, name
        assert (worker.ray_start_params or {}) == shape.ray_start_params(), name
        for section in ("requests", "limits"):
            assert _flyte_resources(getattr(worker, section)) == shape.k8s_resources(), (name, section)
    assert cfg.shutdown_after_job_finishes is True
    assert not cfg.enable_autoscaling
