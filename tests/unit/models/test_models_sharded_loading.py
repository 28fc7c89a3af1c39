"""Meta-device init and in-place safetensors loading (`empty_model`, `materialize`, `load_safetensors_into`): the
building blocks of the sharded policy/reference load, checked here on one process against a plain `load_model`.
The sharded (2-rank FSDP2) version is tests/unit/train/test_sharded_memory.py."""

from __future__ import annotations

import pytest
import torch

from rlpipe.errors import ConfigError
from rlpipe.models.loading import empty_model, load_model, load_safetensors_into, materialize
from rlpipe.models.tiny import TinyModelConfig, create_tiny_model_dir

SHAPES = {
    "qwen2-tied": TinyModelConfig(),
    "llama-untied": TinyModelConfig(arch="llama", tie_word_embeddings=False, num_layers=3, num_kv_heads=2),
}


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def model_dir(request, tmp_path_factory) -> str:
    return create_tiny_model_dir(tmp_path_factory.mktemp(request.param) / "m", SHAPES[request.param], seed=3)


def test_empty_model_has_meta_parameters_real_buffers_and_its_tie(model_dir):
    plain = load_model(model_dir)
    empty = empty_model(model_dir)
    assert all(p.device.type == "meta" for p in empty.parameters())
    assert [n for n, _ in empty.named_parameters()] == [n for n, _ in plain.named_parameters()]
    tied = plain.config.tie_word_embeddings
    assert (empty.lm_head.weight is empty.model.embed_tokens.weight) is tied
    buffers = dict(plain.named_buffers())
    assert buffers, "the tiny model has RoPE buffers; this test checks they survive meta init"
    for name, value in empty.named_buffers():
        assert value.device.type == "cpu" and torch.equal(value, buffers[name]), name


def test_materialize_then_load_equals_the_plain_load_exactly(model_dir):
    plain = load_model(model_dir)
    model = empty_model(model_dir)
    materialize(model, "cpu")
    load_safetensors_into(model, model_dir)
    got, want = model.state_dict(), plain.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    if plain.config.tie_word_embeddings:  # still one parameter: an update of one is an update of the other
        assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.tensor([[1, 7, 9, 4, 12, 30]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)


def test_load_converts_the_file_dtype_like_from_pretrained(model_dir):
    model = empty_model(model_dir, dtype="bfloat16")
    materialize(model, "cpu")
    load_safetensors_into(model, model_dir)
    plain = load_model(model_dir, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_dir_without_safetensors_or_with_missing_weights_is_a_clear_error(tmp_path, model_dir):
    from safetensors.torch import load_file, save_file

    plain = load_model(model_dir)
    bin_dir = tmp_path / "bin"
    plain.save_pretrained(bin_dir, safe_serialization=False)
    if not any(bin_dir.glob("*.safetensors")):  # transformers 5 may always write safetensors
        model = empty_model(bin_dir)
        materialize(model, "cpu")
        with pytest.raises(ConfigError, match="safetensors"):
            load_safetensors_into(model, bin_dir)
    cut = tmp_path / "cut"
    plain.save_pretrained(cut, safe_serialization=True)
    weights = load_file(cut / "model.safetensors")
    weights.pop("model.norm.weight")
    save_file(weights, cut / "model.safetensors", metadata={"format": "pt"})
    model = empty_model(cut)
    materialize(model, "cpu")
    with pytest.raises(ConfigError, match="model.norm.weight"):
        load_safetensors_into(model, cut)
