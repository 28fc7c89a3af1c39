"""rlpipe.models.lora: injection, init, the base view, and the on-disk adapter that peft (and vLLM) load; the config
rules of model.lora; the vLLM LoRA flags."""

from __future__ import annotations

import math

import pytest
import torch

from rlpipe.config import load_config
from rlpipe.errors import ConfigError
from rlpipe.models.lora import (
    LoRAConfig,
    adapter_state,
    adapters_disabled,
    apply_lora,
    init_adapter_weights,
    is_adapter_param,
    peft_lora_config,
)
from rlpipe.models.tiny import TinyModelConfig, build_tiny_model


def _model(arch: str = "qwen2", seed: int = 0):
    return build_tiny_model(TinyModelConfig(arch=arch), vocab_size=40, seed=seed).eval()


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_default_targets_cover_every_projection_and_only_adapters_train(arch):
    model = apply_lora(_model(arch), LoRAConfig(rank=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_param(n) for n in trainable)
    projections = {n.split(".lora_")[0].rsplit(".", 1)[1] for n in trainable}
    assert projections == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_a_fresh_adapter_is_the_base_model_and_a_trained_one_is_not():
    ids = [1, 4, 9, 16, 25, 36, 7]
    base = _logits(_model(), ids)
    model = apply_lora(_model(), LoRAConfig(rank=4, alpha=8))
    init_adapter_weights(model, seed=3)
    torch.testing.assert_close(_logits(model, ids), base, rtol=0, atol=0)  # B = 0
    a = next(p for n, p in model.named_parameters() if ".lora_A." in n).detach()
    assert float(a.abs().max()) <= 1 / math.sqrt(a.shape[1]) and float(a.std()) > 0  # kaiming-uniform bound
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    assert float((_logits(model, ids) - base).abs().max()) > 1e-3
    with adapters_disabled(model):
        torch.testing.assert_close(_logits(model, ids), base, rtol=0, atol=1e-6)
    assert float((_logits(model, ids) - base).abs().max()) > 1e-3  # restored on exit
    assert all(p.requires_grad for n, p in model.named_parameters() if is_adapter_param(n))


def test_adapter_init_is_a_function_of_seed_and_name_only():
    one, two = apply_lora(_model(seed=0), LoRAConfig()), apply_lora(_model(seed=1), LoRAConfig())
    torch.manual_seed(123)
    init_adapter_weights(one, seed=7)
    torch.manual_seed(456)  # the global RNG plays no part
    init_adapter_weights(two, seed=7)
    for (n, p), (_, q) in zip(one.named_parameters(), two.named_parameters(), strict=True):
        if is_adapter_param(n):
            assert torch.equal(p, q), n


def test_adapter_dir_loads_in_peft_and_reproduces_the_model(tmp_path):
    from peft import PeftModel

    from rlpipe.rollout.serving_dir import published_bytes, write_adapter_dir

    cfg = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = apply_lora(_model(), cfg)
    init_adapter_weights(model, seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    path = write_adapter_dir(adapter_state(dict(model.named_parameters())), peft_lora_config(cfg), tmp_path, 5)
    assert path.name == "v00000005" and (path / "adapter_config.json").is_file()
    assert 0 < published_bytes(path) < sum(p.numel() * 4 for p in _model().parameters()) / 10
    loaded = PeftModel.from_pretrained(_model(), str(path))
    ids = [2, 3, 5, 7, 11, 13]
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=1e-6)


def test_unmatched_target_modules_name_the_field():
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules=\['c_attn'\]"):
        apply_lora(_model(), LoRAConfig(target_modules=["c_attn"]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"train.ref_load_from": "/some/model"}, "train.ref_load_from"),
        ({"rollout.engine": "sglang", "rollout.server_url": "http://x"}, "sglang"),
        ({"rollout.engine": "vllm", "rollout.weight_sync.method": "nccl"}, "method=nccl"),
    ],
)
def test_lora_config_rules(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"model.lora.enabled": True, **overrides})
    load_config(overrides=overrides)  # each is fine without LoRA


def test_vllm_lora_flags_and_adapter_names():
    from rlpipe.rollout.vllm_lora import adapter_name, lora_server_args

    assert lora_server_args(16)[:3] == ["--enable-lora", "--max-lora-rank", "16"]
    assert lora_server_args(4)[2] == "8" and lora_server_args(300)[2] == "320"
    assert adapter_name("policy", 42) == "policy-lora-v00000042"
    with pytest.raises(ValueError, match="up to rank 512"):
        lora_server_args(600)
