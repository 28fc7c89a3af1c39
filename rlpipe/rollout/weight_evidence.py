"""Engine-side evidence that a load changed the served weights (issue 33): per-parameter checksums and the version.

The probe compares logprobs, so an update too small to see through the engine's numeric noise leaves it
inconclusive. vLLM (dev mode) reports a sha256 per engine parameter (`POST /weight_checker {"action": "checksum"}`)
and the version it was last tagged with (`GET /weight_info`). After a load, every engine parameter fed by a
published tensor that changed since the previous published version must have a new checksum, and no other one may
move: a skipped load, a layer or LM head left out, or a load of another directory fails here naming the parameter.
It proves the bytes moved, not that they are the right ones (that is the probe's job).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from rlpipe.errors import WeightSyncError
from rlpipe.rollout.serving_dir import WEIGHTS_FILE

# sha256 of no bytes: vLLM's CPU backend packs linear weights for oneDNN / sgl kernels and leaves the parameter
# empty (`dispatch_cpu_unquantized_gemm(remove_weight=True)`), so its checksum never moves: not observable.
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()

# HF projection names vLLM fuses into one parameter (Llama/Qwen/Mistral families).
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}  # fmt: skip


def published_digests(serving_dir: str | Path, only: set[str] | None = None) -> dict[str, str]:
    """sha256 of every tensor's bytes in a serving directory's safetensors (what changed between two publishes);
    `only`: just these names (the ones whose engine checksum can move: hashing the rest is wasted time)."""
    import torch
    from safetensors import safe_open

    out: dict[str, str] = {}
    with safe_open(str(Path(serving_dir) / WEIGHTS_FILE), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            if only is not None and name not in only:
                continue
            t = f.get_tensor(name).contiguous()
            out[name] = hashlib.sha256(t.view(-1).view(torch.uint8).numpy()).hexdigest()
    return out


def engine_param_name(hf_name: str) -> str:
    """The vLLM parameter an HF tensor is loaded into (`q_proj`, `k_proj`, `v_proj` -> `qkv_proj`, ...)."""
    return ".".join(_FUSED.get(part, part) for part in hf_name.split("."))


def observable_names(hf_names: list[str], engine_checksums: dict[str, str]) -> set[str]:
    """The HF tensors whose engine parameter exists and is not kept empty (`EMPTY_DIGEST`): only their checksums
    can show a load."""
    grouped = strip_rank(engine_checksums)
    return {n for n in hf_names if any(d != EMPTY_DIGEST for d in grouped.get(engine_param_name(n), ()))}


def published_names(serving_dir: str | Path) -> list[str]:
    """The tensor names of a serving directory (the safetensors header only)."""
    from safetensors import safe_open

    with safe_open(str(Path(serving_dir) / WEIGHTS_FILE), framework="pt") as f:
        return list(f.keys())


def strip_rank(checksums: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """vLLM keys are `dp0:pp0:pcp0:tp0:<param>`: group the shards of each parameter (all must move together)."""
    out: dict[str, list[str]] = {}
    for key in sorted(checksums):
        out.setdefault(key.rsplit(":", 1)[-1], []).append(checksums[key])
    return {k: tuple(v) for k, v in out.items()}


def check_checksums_moved(
    before: dict[str, str],
    after: dict[str, str],
    changed_hf: set[str],
    unchanged_hf: set[str],
    engine: str,
    version: int,
    strict: bool = True,
) -> dict[str, float]:
    """Raise `WeightSyncError` unless the engine parameters fed by `changed_hf` got new checksums and none fed only
    by `unchanged_hf` did (a tensor the previous directory lacked, e.g. a tied head, is in neither: not checked).

    `strict=False` (the engine casts to a lower precision than was published): a small update can round to the same
    bf16 values for a whole small tensor (a norm), so only "none moved" fails; the stuck count is a metric.
    Parameters the engine keeps empty (packed elsewhere, `EMPTY_DIGEST`) are counted as unobservable, not checked.
    Returns counts for metrics. HF tensors with no engine parameter of the mapped name (e.g. a tied head that vLLM
    shares with the embedding) are counted as unmapped, not checked."""
    b, a = strip_rank(before), strip_rank(after)
    expected = {engine_param_name(n) for n in changed_hf}
    unmapped = {n for n in expected if n not in a}
    unobservable = {n for n in expected - unmapped if all(d == EMPTY_DIGEST for d in a[n])}
    expected -= unmapped | unobservable
    moved = {n for n in a if b.get(n) != a[n]}
    stuck = sorted(n for n in expected if n not in moved)
    if stuck and (strict or len(stuck) == len(expected)):
        raise WeightSyncError(
            f"rollout engine {engine} after loading version {version}: the checksum of {len(stuck)} of "
            f"{len(expected)} updated parameters did not change: {', '.join(stuck[:6])}"
            f"{' ...' if len(stuck) > 6 else ''}. The load skipped them (or the whole load did not happen)."
        )
    extra = sorted(moved & {engine_param_name(n) for n in unchanged_hf} - expected)
    if extra:
        raise WeightSyncError(
            f"rollout engine {engine} after loading version {version}: {len(extra)} parameters changed that the "
            f"update did not change: {', '.join(extra[:6])}. It loaded weights from somewhere else."
        )
    return {
        "engine/checksum_params_moved": float(len(moved)),
        "engine/checksum_params_stuck": float(len(stuck)),
        "engine/checksum_params_unmapped": float(len(unmapped)),
        "engine/checksum_params_unobservable": float(len(unobservable)),
    }
