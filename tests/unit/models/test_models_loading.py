"""HF loading: clear ConfigErrors, no remote code by default, tokenizer/model mismatch detection."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlpipe.errors import ConfigError
from rlpipe.models.loading import (
    check_tokenizer_matches,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    resolve_dtype,
)
from rlpipe.models.tiny import TinyModelConfig, build_tiny_model, create_tiny_model_dir
from rlpipe.models.tokenizer import build_tiny_tokenizer

SMALL = TinyModelConfig(hidden_size=16, intermediate_size=32, num_layers=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny", SMALL, seed=0)


def test_missing_dir(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_dir_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path)


def test_dir_without_weights(tmp_path, model_dir):
    (tmp_path / "config.json").write_text(open(f"{model_dir}/config.json").read())
    with pytest.raises(ConfigError, match="cannot load model"):
        load_model(tmp_path)


def test_load_dtype_and_eval(model_dir):
    m = load_model(model_dir, dtype="bfloat16")
    assert m.dtype == torch.bfloat16 and not m.training
    assert m.config._attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match="unknown dtype"):
        resolve_dtype("float8")


def test_trust_remote_code_defaults_to_false(monkeypatch, model_dir):
    seen = {}

    def fake_model(path, **kw):
        seen["model"] = kw
        return build_tiny_model(SMALL, 200, 0)

    def fake_tok(path, **kw):
        seen["tok"] = kw
        return build_tiny_tokenizer()

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fake_tok)
    load_model(model_dir)
    load_tokenizer(model_dir)
    assert seen["model"]["trust_remote_code"] is False
    assert seen["tok"]["trust_remote_code"] is False
    assert seen["model"]["local_files_only"] is True
    load_model(model_dir, trust_remote_code=True)
    assert seen["model"]["trust_remote_code"] is True


def test_tokenizer_larger_than_embedding_is_rejected(tmp_path, model_dir):
    small = build_tiny_model(SMALL, vocab_size=50, seed=0)  # char tokenizer has > 100 tokens
    small.save_pretrained(tmp_path)
    build_tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="mismatch"):
        load_model_and_tokenizer(tmp_path)
    # a model embedding larger than the tokenizer (padded vocab) is fine
    big = build_tiny_model(SMALL, vocab_size=256, seed=0)
    check_tokenizer_matches(big, build_tiny_tokenizer())
    m, tok = load_model_and_tokenizer(model_dir)
    assert tok.padding_side == "left" and tok.pad_token_id == 0


def test_pad_token_falls_back_to_eos(tmp_path):
    import json

    tok = build_tiny_tokenizer()
    tok.save_pretrained(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("pad_token", None)
    cfg_path.write_text(json.dumps(cfg))
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token_id == loaded.eos_token_id == 2
