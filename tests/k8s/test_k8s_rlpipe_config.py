"""The rlpipe configs shipped in the rlpipe-config ConfigMap are valid PipelineConfigs.

Separate file because importing rlpipe.config pulls in torch and transformers (several seconds on a small machine).
"""

from __future__ import annotations

import pytest
from k8s_objects import one


@pytest.mark.parametrize("where", ["base", "overlays/cpu-dev", "overlays/gpu"])
def test_configmap_configs_validate(rendered, where):
    from rlpipe.config import validate_config

    data = one(rendered[where], "ConfigMap", "rlpipe-config")["data"]
    assert set(data) == {"grpo.yaml", "grpo-gpu.yaml"}
    for name, text in data.items():
        import yaml

        cfg = validate_config(yaml.safe_load(text), source=f"{where}:{name}")
        assert cfg.checkpoint_dir.is_absolute()
        assert cfg.train.device == ("cuda" if "gpu" in name else "cpu")


def test_gpu_rayjob_rolls_out_from_engine_replicas_on_the_rollout_group_and_its_head_has_no_gpu(rendered):
    """The gpu overlay's job rolls out from managed vLLM replicas on the rollout-workers pods (each server on its pod's
    127.0.0.1, so vLLM's unauthenticated admin routes stay inside the pod); the head runs only the driver and requests
    no GPU, and no pod requests a GPU that no Ray consumer can use. The cpu-dev job keeps the HF engine."""
    import yaml
    from k8s_objects import cluster_spec

    from rlpipe.config import validate_config

    for where, engine in (("overlays/gpu", "vllm"), ("overlays/cpu-dev", "hf")):
        objects = rendered[where]
        job = one(objects, "RayJob")
        name = job["spec"]["entrypoint"].split()[2].rsplit("/", 1)[1]
        cfg = validate_config(yaml.safe_load(one(objects, "ConfigMap", "rlpipe-config")["data"][name]), source=name)
        assert cfg.rollout.engine == engine, where
        head = cluster_spec(job)["headGroupSpec"]
        assert head["rayStartParams"]["num-gpus"] == "0", where
        for section in ("requests", "limits"):
            assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"][section], where
        assert "nodeSelector" not in head["template"]["spec"] and "tolerations" not in head["template"]["spec"], where
        if engine == "vllm":
            assert cfg.rollout.server_url is None and cfg.rollout.vllm.host == "127.0.0.1"  # managed, pod-local
            from images.deploy import GPU_ROLLOUT, ROLLOUT_RESOURCE

            # one replica per rollout-workers pod, placed there by the resource only those pods advertise
            assert cfg.rollout.vllm.replicas == GPU_ROLLOUT.replicas
            assert cfg.rollout.vllm.resources == {"GPU": 1, ROLLOUT_RESOURCE: 1}
            assert cfg.rollout.weight_sync.method == "disk" and cfg.output_dir.startswith("/data/")
            # every GPU a pod requests has a Ray consumer: trainer ranks on gpu-workers, replicas on rollout-workers
            groups = {g["groupName"]: g for g in cluster_spec(job)["workerGroupSpecs"]}
            gpus = {n: int(g["template"]["spec"]["containers"][0]["resources"]["requests"].get("nvidia.com/gpu", 0))
                    * g["replicas"] for n, g in groups.items()}  # fmt: skip
            assert gpus == {"gpu-workers": cfg.train.world_size, "rollout-workers": cfg.rollout.vllm.replicas}


def test_gpu_trainers_are_pinned_to_the_trainer_group_by_a_custom_resource(rendered):
    """grpo-gpu.yaml's train.resources names a resource only the trainer pods advertise, so the rollout group's GPUs
    stay the engines'; and KubeRay's shell line turns the quoted rayStartParams value back into that JSON."""
    import json
    import subprocess

    import yaml
    from k8s_objects import cluster_spec

    from images.deploy import PROFILES
    from rlpipe.config import validate_config

    objects = rendered["overlays/gpu"]
    cfg = validate_config(yaml.safe_load(one(objects, "ConfigMap", "rlpipe-config")["data"]["grpo-gpu.yaml"]))
    groups = {g["groupName"]: g for g in cluster_spec(one(objects, "RayJob"))["workerGroupSpecs"]}
    assert set(groups) == {"gpu-workers", "rollout-workers"}
    advertised = {}
    for name, group in groups.items():
        line = f"ray start --resources={group['rayStartParams']['resources']}"
        argv = subprocess.run(["bash", "-c", f"printf '%s\\n' {line}"], capture_output=True, text=True, check=True)
        advertised[name] = json.loads(argv.stdout.splitlines()[-1].split("=", 1)[1])
    assert advertised == {"gpu-workers": {"trainer": 1}, "rollout-workers": {"rollout_engine": 1}}
    assert cfg.train.resources == {"trainer": 1.0}
    assert set(cfg.train.resources) <= set(advertised["gpu-workers"])
    assert not set(cfg.train.resources) & set(advertised["rollout-workers"])
    assert cfg.train.world_size <= PROFILES["gpu"].worker.replicas * advertised["gpu-workers"]["trainer"]
