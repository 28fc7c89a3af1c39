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


def test_gpu_rayjob_serves_rollouts_from_a_vllm_server_on_its_head(rendered):
    """The gpu overlay's job rolls out with a vLLM server the driver starts on the head's GPU (reached at 127.0.0.1,
    so vLLM's unauthenticated admin routes stay inside the pod); Ray advertises no GPU there, so the TrainingWorkers
    keep the worker GPUs. The cpu-dev job keeps the HF engine and a GPU-less head."""
    import yaml
    from k8s_objects import cluster_spec

    from rlpipe.config import validate_config

    for where, engine, head_gpus in (("overlays/gpu", "vllm", "1"), ("overlays/cpu-dev", "hf", None)):
        objects = rendered[where]
        job = one(objects, "RayJob")
        name = job["spec"]["entrypoint"].split()[2].rsplit("/", 1)[1]
        cfg = validate_config(yaml.safe_load(one(objects, "ConfigMap", "rlpipe-config")["data"][name]), source=name)
        assert cfg.rollout.engine == engine, where
        head = cluster_spec(job)["headGroupSpec"]
        assert head["rayStartParams"]["num-gpus"] == "0", where
        assert head["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu") == head_gpus
        if engine == "vllm":
            assert cfg.rollout.server_url is None and cfg.rollout.vllm.host == "127.0.0.1"  # managed, pod-local
            assert cfg.rollout.weight_sync.method == "disk" and cfg.output_dir.startswith("/data/")
