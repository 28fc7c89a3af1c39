"""`rlpipe.models.shard_reader`: positioned reads of row ranges, checked against safetensors' own loader."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlpipe.errors import ConfigError
from rlpipe.models.shard_reader import load_rows, read_index, read_rows_into


@pytest.fixture
def stored(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "emb": torch.randn(7, 5, generator=g),
        "half": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "bias": torch.randn(5, generator=g),
        "scalar": torch.tensor(2.5),
        "ids": torch.arange(6, dtype=torch.int64).reshape(3, 2),
    }
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path, load_file(tmp_path / "model.safetensors")


def test_every_row_range_equals_the_slice_safetensors_loads(stored):
    model_dir, reference = stored
    index = read_index(model_dir)
    for name in ("emb", "half", "bias", "ids"):
        rows = reference[name].shape[0]
        for start in range(rows):
            for stop in range(start, rows + 1):
                target = torch.empty((stop - start, *reference[name].shape[1:]), dtype=reference[name].dtype)
                read_rows_into(index[name], target, start, name)
                assert torch.equal(target, reference[name][start:stop]), (name, start, stop)


def test_dtype_conversion_and_scalars(stored):
    model_dir, reference = stored
    index = read_index(model_dir)
    as_fp32 = torch.empty(2, 3)
    read_rows_into(index["half"], as_fp32, 1, "half")  # bf16 file -> fp32 model (through one shard-sized buffer)
    assert torch.equal(as_fp32, reference["half"][1:3].float())
    scalar = torch.empty(())
    read_rows_into(index["scalar"], scalar, 0, "scalar")
    assert scalar.item() == 2.5
    column = torch.empty(7, 5).t()  # a non-contiguous target is filled through the buffer as well
    read_rows_into(index["emb"], column.t(), 0, "emb")
    assert torch.equal(column.t(), reference["emb"])


def test_shape_mismatch_and_missing_names_are_clear_errors(stored):
    model_dir, _ = stored
    index = read_index(model_dir)
    with pytest.raises(ConfigError, match="'emb' has shape \\[7, 5\\]"):
        read_rows_into(index["emb"], torch.empty(2, 4), 0, "emb")
    with pytest.raises(ConfigError, match="rows from 6"):
        read_rows_into(index["emb"], torch.empty(2, 5), 6, "emb")
    with pytest.raises(ConfigError, match="lack \\['absent'\\]"):
        load_rows({"absent": torch.empty(1)}, index, model_dir)


def test_truncated_or_garbled_files_name_the_file(stored, tmp_path):
    model_dir, _ = stored
    data = (model_dir / "model.safetensors").read_bytes()
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(data[:-8])
    index = read_index(cut)
    last = max(index, key=lambda n: index[n].offset)
    target = torch.empty(index[last].shape, dtype=index[last].dtype)
    with pytest.raises(ConfigError, match="truncated"):
        read_rows_into(index[last], target, 0, last)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(ConfigError, match="bad.*not a safetensors file"):
        read_index(bad)
