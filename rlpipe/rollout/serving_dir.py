"""Published weights on disk: the HF model directory a server engine reloads after an update, or (LoRA) the peft
adapter directory it loads beside the base model.

A directory per weight version (`v00000042`), written under a temporary name and renamed, so an engine (or a
restarted one) never reads half of one; the LM head is written explicitly even when tied (`serving_state_dict`).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch

# Files of a model directory that the server needs besides the weights (config, tokenizer, generation defaults).
_MODEL_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
WEIGHTS_FILE = "model.safetensors"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"  # peft's name
VERSION_FILE = "rlpipe_weight_version.json"


def serving_state_dict(
    state: dict[str, torch.Tensor], input_embedding_key: str | None, output_embedding_key: str | None
) -> dict[str, torch.Tensor]:
    """The tensors an engine must load: every weight, and the LM head written explicitly even when it is tied.

    With `tie_word_embeddings`, HF checkpoints omit `lm_head.weight`; vLLM's in-place reload then leaves its LM head
    at the weights it started with (measured on vLLM 0.32: "ParallelLMHead: Failed to load weights", probe diff
    0.89). Writing the head explicitly makes the reload complete (probe diff 1e-6).
    """
    out = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    if output_embedding_key and output_embedding_key not in out and input_embedding_key in out:
        out[output_embedding_key] = out[input_embedding_key]
    # safetensors refuses tensors that share memory; a tied head becomes its own copy.
    seen: dict[int, str] = {}
    for name in list(out):
        ptr = out[name].data_ptr()
        if ptr in seen:
            out[name] = out[name].clone()
        else:
            seen[ptr] = name
    return out


def write_serving_dir(
    state: dict[str, torch.Tensor], model_dir: str | Path, root: str | Path, version: int, keep: int = 2
) -> Path:
    """Write a complete HF model directory (config, tokenizer, `model.safetensors`) for `version` under `root`.

    Written to a temporary name and renamed, so an engine (or a restart) never reads a half-written directory.
    Older versions beyond the newest `keep` are removed. Returns the directory.
    """

    def fill(tmp: Path) -> None:
        _copy_side_files(model_dir, tmp)
        _save_weights(state, tmp / WEIGHTS_FILE)

    return _publish_version(root, version, keep, fill)


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def serving_buffer(state: dict[str, torch.Tensor]) -> np.ndarray:
    """The `model.safetensors` of a serving directory, built in one uint8 array: what travels to engines on other
    nodes. Each tensor is copied once, straight into place (no intermediate `bytes`), and an array (unlike `bytes`)
    travels through Ray's object store out of band: the receiving actor reads it in place, without a copy.

    The layout is the safetensors format: an 8-byte little-endian header length, the JSON header (space-padded to
    8 bytes), then the tensors back to back, widest dtype first so every tensor starts aligned to its element size.
    """
    tensors = sorted(state.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors:
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"serving weights: tensor {name!r} has dtype {t.dtype}, which safetensors cannot hold")
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    buf = np.empty(8 + len(head) + offset, dtype=np.uint8)
    buf[:8] = np.frombuffer(len(head).to_bytes(8, "little"), dtype=np.uint8)
    buf[8 : 8 + len(head)] = np.frombuffer(head, dtype=np.uint8)
    start = 8 + len(head)
    for name, t in tensors:
        begin, end = header[name]["data_offsets"]  # type: ignore[index]
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        if end > begin:
            buf[start + begin : start + end] = flat.view(torch.uint8).numpy()
    return buf


def write_serving_buffer(weights, model_dir: str | Path, root: str | Path, version: int, keep: int = 2) -> Path:
    """`write_serving_dir` from `serving_buffer` (an engine node writing its own local copy of a version);
    `weights`: that array, or any bytes-like object holding a `model.safetensors`."""

    def fill(tmp: Path) -> None:
        _copy_side_files(model_dir, tmp)
        with open(tmp / WEIGHTS_FILE, "wb") as f:
            f.write(memoryview(weights).cast("B"))
            os.fsync(f.fileno())

    return _publish_version(root, version, keep, fill)


def write_files(files: dict[str, bytes], directory: Path) -> None:
    """Write `files` (name -> content) into `directory`, each flushed to disk; only a name's last component is used,
    so nothing lands outside `directory`."""
    for name, data in files.items():
        with open(directory / Path(name).name, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())


def write_version_files(files: dict[str, bytes], root: str | Path, version: int, keep: int = 2) -> Path:
    """A version directory under `root` holding `files` (name -> content; e.g. a peft adapter directory's files
    sent through the object store), written atomically like `write_serving_dir`."""
    return _publish_version(root, version, keep, lambda tmp: write_files(files, tmp))


def model_dir_files(model_dir: str | Path) -> dict[str, bytes]:
    """Every file at the top of a model directory, by name: the base model an engine node without the driver's
    filesystem starts from (sent once through Ray's object store)."""
    return {p.name: p.read_bytes() for p in sorted(Path(model_dir).iterdir()) if p.is_file()}


def _copy_side_files(model_dir: str | Path, tmp: Path) -> None:
    for name in _MODEL_SIDE_FILES:
        src = Path(model_dir) / name
        if src.is_file():
            shutil.copy2(src, tmp / name)


def write_adapter_dir(
    state: dict[str, torch.Tensor], peft_config, root: str | Path, version: int, keep: int = 2
) -> Path:
    """Write a peft adapter directory (`adapter_config.json` + `adapter_model.safetensors`, the layout
    `PeftModel.from_pretrained` and vLLM's `/v1/load_lora_adapter` read) for `version` under `root`, atomically
    like `write_serving_dir`. `state`: peft-named adapter tensors (`rlpipe.models.lora.adapter_state`)."""

    return _publish_version(root, version, keep, lambda tmp: save_adapter(state, peft_config, tmp))


def save_adapter(state: dict[str, torch.Tensor], peft_config, out_dir: str | Path) -> Path:
    """`adapter_config.json` + `adapter_model.safetensors` into `out_dir` (created): a peft adapter directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    peft_config.save_pretrained(str(out))
    _save_weights(state, out / ADAPTER_WEIGHTS_FILE)
    return out


def _save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(state, str(path), metadata={"format": "pt"})
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def published_bytes(path: str | Path | None) -> int:
    """Bytes of the weight files in a published directory (what an engine reads per sync); 0 for None or for what
    is not a path (the object-store artifact of engine replicas: `RemoteEngine.last_load_bytes` counts those)."""
    if not isinstance(path, str | Path):
        return 0
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def _publish_version(root: str | Path, version: int, keep: int, fill) -> Path:
    """`fill(tmp)` a temporary directory, then rename it to `root/v{version:08d}`; keep the newest `keep`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{version:08d}"
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        fill(tmp)
        (tmp / VERSION_FILE).write_text(json.dumps({"version": version}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(p for p in root.iterdir() if p.name.startswith("v") and p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def serving_dir_version(path: str | Path) -> int | None:
    """The version a serving directory holds (None if it is not one rlpipe wrote)."""
    f = Path(path) / VERSION_FILE
    return int(json.loads(f.read_text())["version"]) if f.is_file() else None
