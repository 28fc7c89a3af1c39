"""Tiny default model: config validation, determinism, and a model dir that loads like a real one."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from rlpipe.errors import ConfigError
from rlpipe.models.loading import load_model_and_tokenizer
from rlpipe.models.tiny import TinyModelConfig, build_tiny_model, create_tiny_model_dir, tiny_hf_config


def test_config_forbids_unknown_fields_and_bad_arch():
    with pytest.raises(ValidationError):
        TinyModelConfig(hidden=64)
    with pytest.raises(ValidationError):
        TinyModelConfig(arch="gpt2")


@pytest.mark.parametrize(
    "kwargs", [dict(hidden_size=60, num_heads=8), dict(num_heads=4, num_kv_heads=3), dict(hidden_size=12, num_heads=4)]
)
def test_inconsistent_shapes_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        tiny_hf_config(TinyModelConfig(**kwargs), vocab_size=10)


@pytest.mark.parametrize("arch,cls", [("qwen2", "Qwen2ForCausalLM"), ("llama", "LlamaForCausalLM")])
def test_build_matches_config(arch, cls):
    cfg = TinyModelConfig(arch=arch)
    m = build_tiny_model(cfg, vocab_size=40, seed=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert type(m).__name__ == cls
    c = m.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (64, 2, 2, 1)
    assert c.hidden_size // c.num_attention_heads == 32  # the smallest head_dim vLLM CPU attention supports
    assert (c.intermediate_size, c.max_position_embeddings, c.vocab_size) == (256, 256, 40)
    assert m.get_output_embeddings().weight is m.get_input_embeddings().weight  # tied
    assert (c.pad_token_id, c.bos_token_id, c.eos_token_id) == (0, 1, 2)
    assert not m.training


def test_seed_determinism_and_rng_isolation():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_model(TinyModelConfig(), 30, seed=5)
    after = torch.rand(1)
    assert torch.equal(before, after)  # building did not consume the global RNG
    b = build_tiny_model(TinyModelConfig(), 30, seed=5)
    c = build_tiny_model(TinyModelConfig(), 30, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_model_dir_round_trip(tmp_path):
    d = create_tiny_model_dir(tmp_path / "tiny", TinyModelConfig(num_layers=1), seed=3)
    names = {p.name for p in (tmp_path / "tiny").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)
    gen = json.loads((tmp_path / "tiny" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["pad_token_id"] == 0
    model, tok = load_model_and_tokenizer(d)
    ref = build_tiny_model(TinyModelConfig(num_layers=1), len(tok), seed=3)
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "reverse 12"}], return_dict=False)])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)
    assert model.config.vocab_size == len(tok)
