"""Published weights on disk: the HF model directory a server engine reloads after an update.

A directory per weight version (`v00000042`), written under a temporary name and renamed, so an engine (or a
restarted one) never reads half of one; the LM head is written explicitly even when tied (`serving_state_dict`).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

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
    from safetensors.torch import save_file

    return _write_version_dir(
        lambda path: save_file(state, str(path), metadata={"format": "pt"}), model_dir, root, version, keep
    )


def serving_bytes(state: dict[str, torch.Tensor]) -> bytes:
    """The `model.safetensors` of a serving directory, in memory: what travels to engines on other nodes."""
    from safetensors.torch import save

    return save(state, metadata={"format": "pt"})


def write_serving_bytes(weights: bytes, model_dir: str | Path, root: str | Path, version: int, keep: int = 2) -> Path:
    """`write_serving_dir` from `serving_bytes` (an engine node writing its own local copy of a version)."""
    return _write_version_dir(lambda path: Path(path).write_bytes(weights), model_dir, root, version, keep)


def _write_version_dir(write_weights, model_dir: str | Path, root: str | Path, version: int, keep: int) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{version:08d}"
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for name in _MODEL_SIDE_FILES:
            src = Path(model_dir) / name
            if src.is_file():
                shutil.copy2(src, tmp / name)
        write_weights(tmp / WEIGHTS_FILE)
        (tmp / VERSION_FILE).write_text(json.dumps({"version": version}))
        with open(tmp / WEIGHTS_FILE, "rb") as f:
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(p for p in root.iterdir() if p.name.startswith("v") and p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def model_dir_files(model_dir: str | Path) -> dict[str, bytes]:
    """Every file at the top of a model directory, by name: the base model an engine node without the driver's
    filesystem starts from (sent once through Ray's object store)."""
    return {p.name: p.read_bytes() for p in sorted(Path(model_dir).iterdir()) if p.is_file()}


def serving_dir_version(path: str | Path) -> int | None:
    """The version a serving directory holds (None if it is not one rlpipe wrote)."""
    f = Path(path) / VERSION_FILE
    return int(json.loads(f.read_text())["version"]) if f.is_file() else None
