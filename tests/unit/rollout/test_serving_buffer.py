"""`serving_buffer`: the safetensors file built in one array must be a file safetensors itself reads back exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load

from rlpipe.rollout.serving_dir import WEIGHTS_FILE, serving_buffer, write_serving_buffer


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(7, 5, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(5, generator=g).to(torch.float16),
        "position_ids": torch.arange(11, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(4, 6, generator=g).t(),  # not contiguous: written in logical order
    }


def test_safetensors_reads_back_every_tensor_bit_for_bit():
    state = _state()
    buf = serving_buffer(state)
    assert buf.dtype == np.uint8 and buf.ndim == 1
    back = load(buf.tobytes())
    assert set(back) == set(state)
    for name, t in state.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name


def test_header_is_aligned_and_the_buffer_has_no_holes():
    buf = serving_buffer(_state())
    header_len = int.from_bytes(buf[:8].tobytes(), "little")
    assert header_len % 8 == 0
    import json

    header = json.loads(buf[8 : 8 + header_len].tobytes())
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == len(buf) - 8 - header_len
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # back to back


def test_unsupported_dtype_names_the_tensor():
    with pytest.raises(ValueError, match="'c'.*complex64"):
        serving_buffer({"c": torch.zeros(2, dtype=torch.complex64)})


def test_write_serving_buffer_writes_a_loadable_version_dir(tmp_path):
    model_dir = tmp_path / "base"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    state = _state()
    out = write_serving_buffer(serving_buffer(state), model_dir, tmp_path / "serving", 3)
    assert (out / "config.json").read_text() == "{}"
    back = load((out / WEIGHTS_FILE).read_bytes())
    assert all(torch.equal(back[k], v) for k, v in state.items())
