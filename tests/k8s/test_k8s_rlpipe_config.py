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
