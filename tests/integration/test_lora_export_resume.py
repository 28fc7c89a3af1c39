"""model.lora end to end on Ray (hf engine, tiny default): `rlpipe export` gives a peft adapter dir and a merged HF
model that transformers loads (and that equal the trained policy), the manifest records the base weights' hash,
and resuming onto a base with other weights (same architecture) is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_overrides


def _cfg(tmp_path, **extra):
    from rlpipe.config import load_config

    return load_config(
        overrides=tiny_overrides(
            tmp_path,
            **{
                "model.lora.enabled": True,
                "model.lora.rank": 4,
                "train.lr": 1e-2,
                "iterations": 2,
                "segment_size": 2,
                "train.world_size": 2,
                "train.fsdp": True,
                "model.warmup_sft_steps": 180,  # the default warm start: groups with a reward signal
                "rollout.prompts_per_step": 16,
                "rollout.n": 8,
                **extra,
            },
        )
    )


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ray_session):
    from rlpipe.base_model import prepare_base_model
    from rlpipe.loop import run_segment

    tmp = tmp_path_factory.mktemp("lora-export")
    cfg = _cfg(tmp)
    result = run_segment(cfg, None, 2, log=lambda m: None)
    assert any(row["grad_norm"] > 0 for row in result.metrics)  # groups with a reward signal: the adapters moved
    return tmp, cfg, prepare_base_model(cfg, log=lambda m: None), result.checkpoint


def test_export_gives_a_peft_adapter_and_a_merged_model_equal_to_the_policy(trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlpipe.cli import main

    tmp, cfg, base_dir, checkpoint = trained
    out = tmp / "export"
    assert main(["export", checkpoint, str(out)]) == 0
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())  # a plain HF model: the adapter is merged in
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    ids = [1, 5, 9, 14, 20, 7, 3, 11]
    base_logits = _logits(base, ids)
    with_adapter = PeftModel.from_pretrained(base, str(out / "adapter"))
    torch.testing.assert_close(_logits(merged, ids), _logits(with_adapter, ids), rtol=0, atol=1e-4)
    assert float((_logits(merged, ids) - base_logits).abs().max()) > 1e-3  # training moved the adapter
    # the adapter is tiny next to the model
    adapter_bytes = (out / "adapter" / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes < (out / "model.safetensors").stat().st_size / 3


def test_manifest_records_the_base_weights_and_resume_onto_other_weights_is_refused(trained, tmp_path):
    from safetensors.torch import load_file, save_file

    from rlpipe.errors import CheckpointError
    from rlpipe.loop import run_segment
    from rlpipe.train.lineage import model_weights_sha256, read_manifest

    tmp, cfg, base_dir, checkpoint = trained
    assert read_manifest(checkpoint).base_model.weights_sha256 == model_weights_sha256(base_dir)
    other = tmp_path / "other-base"
    shutil.copytree(base_dir, other)
    weights = load_file(other / "model.safetensors")
    name = next(n for n in weights if n.endswith("q_proj.weight"))
    weights[name] = weights[name] + 0.01  # same architecture and shapes, other weights
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    moved = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(other)})})
    with pytest.raises(CheckpointError, match=r"LoRA adapters trained on the base weights .* weights sha256"):
        run_segment(moved, checkpoint, 1, log=lambda m: None)
    # the same base resumes (the checkpoint holds the adapters and their optimizer state only)
    resumed = run_segment(cfg.model_copy(update={"iterations": 3}), checkpoint, 1, log=lambda m: None)
    assert Path(resumed.checkpoint).name == "step-000003"
