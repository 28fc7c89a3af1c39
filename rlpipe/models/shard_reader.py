"""Read each rank's rows of a safetensors file straight into its FSDP2 shards.

Why not ``safe_open`` (or torch DCP's ``HuggingFaceStorageReader``, which uses it): safe_open memory-maps the whole
file and copies every requested slice into a new tensor before it lands in the shard, so a rank's peak RSS holds
its shards, the mapped pages of every slice it read and the allocator's leftovers of the copies: on SmolLM2-135M with
2 ranks, policy plus reference took ~2 models' worth of RSS per rank, more than loading the full model
(``bench/memory_per_rank.py``). Here each tensor's bytes are read with one positioned read into the shard itself
(or, when the file's dtype or device differs, into one buffer of the shard's size), so a rank only ever holds its
own shards.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` (offsets relative to the end of the header), then the
row-major data.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from rlpipe.errors import ConfigError

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are: file, absolute byte offset, dtype and shape."""

    file: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_index(model_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of every ``*.safetensors`` file in ``model_dir``, by name (headers only; no data is read)."""
    index: dict[str, StoredTensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with open(file, "rb") as fh:
            try:
                (length,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(length))
            except (struct.error, ValueError) as e:
                raise ConfigError(f"{file}: not a safetensors file (bad header: {e})") from e
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _SAFETENSORS_DTYPES:
                raise ConfigError(f"{file}: tensor {name!r} has unsupported dtype {info['dtype']}")
            index[name] = StoredTensor(file, 8 + length + info["data_offsets"][0],
                                       _SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]))  # fmt: skip
    return index


def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's local tensor, its first row in the global tensor).

    A DTensor's local chunk comes from ``__create_chunk_list__`` (the protocol torch DCP plans its reads with); only
    row shards (FSDP2's ``Shard(0)``) are supported, which is what rlpipe's sharding produces.
    """
    if not hasattr(tensor, "to_local"):
        return tensor, 0
    chunks = tensor.__create_chunk_list__()
    local = tensor.to_local()
    if not chunks:  # an empty shard (more ranks than rows)
        return local, 0
    (chunk,) = chunks
    if any(chunk.offsets[1:]) or tuple(chunk.sizes[1:]) != tuple(tensor.shape[1:]):
        raise NotImplementedError(f"only row-sharded tensors can be read shard by shard (chunk {chunk})")
    return local, int(chunk.offsets[0])


def read_rows_into(stored: StoredTensor, target: torch.Tensor, first_row: int, name: str) -> None:
    """Fill ``target`` (rows ``first_row:first_row + len(target)`` of the stored tensor) from the file."""
    if stored.shape:
        fits = tuple(target.shape[1:]) == stored.shape[1:] and first_row + target.shape[0] <= stored.shape[0]
    else:
        fits = target.dim() == 0 and first_row == 0
    if not fits:
        raise ConfigError(
            f"{stored.file}: tensor {name!r} has shape {list(stored.shape)}, which does not fit the model's "
            f"{list(target.shape)} (rows from {first_row}); is the model directory the one the config names?"
        )
    if target.numel() == 0:
        return
    row_bytes = math.prod(stored.shape[1:]) * stored.dtype.itemsize
    direct = target.device.type == "cpu" and target.dtype == stored.dtype and target.is_contiguous()
    buffer = target if direct else torch.empty(target.shape, dtype=stored.dtype)
    with open(stored.file, "rb", buffering=0) as fh:
        fh.seek(stored.offset + first_row * row_bytes)
        view = buffer.view(-1).view(torch.uint8).numpy()
        if fh.readinto(view) != view.nbytes:
            raise ConfigError(f"{stored.file}: truncated data for tensor {name!r}")
    if not direct:
        target.copy_(buffer)


def load_rows(named: dict[str, torch.Tensor], index: dict[str, StoredTensor], model_dir: Path) -> None:
    """Fill every tensor of ``named`` (plain or row-sharded DTensors) from the safetensors of ``model_dir`` that
    ``index`` (``read_index``) describes."""
    missing = sorted(set(named) - set(index))
    if missing:
        raise ConfigError(
            f"cannot load {str(model_dir)!r} sharded: its safetensors lack {missing[:5]} ({len(missing)} missing)"
        )
    with torch.no_grad():
        for name, tensor in named.items():
            local, first_row = local_rows(tensor)
            read_rows_into(index[name], local, first_row, name)
