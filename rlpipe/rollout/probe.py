"""The weight-sync contract between the trainer and an inference engine, and the probe that verifies every load.

An engine that serves the policy from its own copy of the weights (a vLLM or SGLang server) must be told about
every update, or it samples from a stale policy while the trainer treats the samples as on-policy: a silent bug.
The contract:

* the trainer's weights carry a version (rlpipe uses the optimizer step: RL and SFT steps both change weights);
* before a rollout, if the engine's served version differs, the policy is published (`write_serving_dir`: a
  complete HF directory with safetensors, `rlpipe.rollout.serving_dir`; on GPUs the NCCL stream of `rlpipe.rollout.nccl_transfer`) and the
  engine loads it (`SyncableEngine.load_weights`: pause, load, reset the prefix cache, resume);
* the load is never trusted: a fixed probe (prompt + response token ids) is scored by the engine and by the trainer
  and compared (`compare_probe`); beyond the tolerance a `WeightSyncError` names the engine, version and max
  difference. This catches partial loads, e.g. vLLM skipping a tied LM head (`serving_state_dict` writes
  `lm_head.weight` explicitly for that reason).

Several optimizer steps between two rollouts cost one sync: syncs are lazy, done when a rollout needs the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from rlpipe.errors import WeightSyncError
from rlpipe.rollout.engine import Generation, SamplingParams


@runtime_checkable
class SyncableEngine(Protocol):
    """A rollout engine with its own copy of the weights that can be told to load new ones and asked what it serves."""

    name: str  # for error messages and metrics, e.g. "vllm http://127.0.0.1:8000"
    served_version: int | None  # the version of the last verified load; None before the first

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...

    def load_weights(self, serving_dir: str, version: int) -> None:
        """Pause generation, load the weights of `serving_dir`, reset cached KV of the old weights, resume."""
        ...

    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """The engine's log-probability of each response token given the prompt and the tokens before it (T=1).
        An engine that can batch also has `score_many(pairs) -> list of those`, one request for all (`score_probe`)."""
        ...


@dataclass(frozen=True)
class ProbeSequence:
    """A fixed prompt + response the engine and the trainer both score after every sync."""

    prompt_ids: list[int]
    response_ids: list[int]


def score_probe(engine, probe: list[ProbeSequence]) -> list[list[float]]:
    """The engine's logprobs of every probe sequence: in one batched request where the engine has `score_many`
    (the vLLM engines), else one `score` per sequence."""
    pairs = [(p.prompt_ids, p.response_ids) for p in probe]
    if hasattr(engine, "score_many"):
        return engine.score_many(pairs)
    return [engine.score(prompt, response) for prompt, response in pairs]


@dataclass(frozen=True)
class ProbeResult:
    """How far the engine's logprobs of the probe are from the trainer's (absolute per-token differences)."""

    max_abs_diff: float
    mean_abs_diff: float
    tokens: int


def build_probe(
    prompts: list[list[int]], vocab_size: int, num_sequences: int, response_length: int, seed: int = 0
) -> list[ProbeSequence]:
    """`num_sequences` prompts of the dataset, each with a seeded pseudo-random response of `response_length` ids.

    The response tokens avoid the lowest ids (pad/bos/eos of most tokenizers live there) so that no stop rule of the
    engine can cut the scored sequence short.
    """
    if not prompts:
        raise WeightSyncError("weight-sync probe: the dataset has no prompts to build a probe from")
    gen = torch.Generator().manual_seed(seed)
    low = min(3, vocab_size - 1)
    probe = []
    for i in range(num_sequences):
        response = torch.randint(low, vocab_size, (response_length,), generator=gen).tolist()
        probe.append(ProbeSequence(list(prompts[i % len(prompts)]), response))
    return probe


def compare_probe(engine_logprobs: list[list[float]], trainer_logprobs: list[list[float]]) -> ProbeResult:
    """Per-token absolute differences between the engine's and the trainer's logprobs of the same probe tokens."""
    if len(engine_logprobs) != len(trainer_logprobs):
        raise WeightSyncError(
            f"weight-sync probe: engine scored {len(engine_logprobs)} sequences, trainer {len(trainer_logprobs)}"
        )
    diffs: list[float] = []
    for i, (e, t) in enumerate(zip(engine_logprobs, trainer_logprobs, strict=True)):
        if len(e) != len(t):
            raise WeightSyncError(f"weight-sync probe: sequence {i}: engine gave {len(e)} logprobs, trainer {len(t)}")
        diffs += [abs(float(a) - float(b)) for a, b in zip(e, t, strict=True)]
    if not diffs:
        raise WeightSyncError("weight-sync probe: no tokens to compare")
    bad = [d for d in diffs if d != d]  # NaN never passes a tolerance check
    worst = float("inf") if bad else max(diffs)
    return ProbeResult(max_abs_diff=worst, mean_abs_diff=sum(diffs) / len(diffs), tokens=len(diffs))


def check_probe(result: ProbeResult, tolerance: float, engine: str, version: int) -> None:
    """Raise `WeightSyncError` when the engine's logprobs are further from the trainer's than `tolerance` allows."""
    if not result.max_abs_diff <= tolerance:
        raise WeightSyncError(
            f"rollout engine {engine} does not serve the policy's weights after syncing version {version}: "
            f"max |logprob difference| on the probe is {result.max_abs_diff:.3g} (mean {result.mean_abs_diff:.3g} "
            f"over {result.tokens} tokens), tolerance {tolerance:g}. A partial or failed load (e.g. a tied LM head "
            "the server did not reload), a dtype the engine computes differently, or a different model in the "
            "server; rollouts from it would not be on-policy."
        )


def default_probe_tolerance(dtype: str) -> float:
    """Max per-token |logprob| difference accepted after a sync: float32 engines match the trainer to ~1e-5
    (measured: 1e-6 on the tiny default with vLLM CPU); bf16/fp16 kernels differ by up to a few 1e-2."""
    return 1e-3 if dtype in ("float32", "fp32") else 0.1


@dataclass(frozen=True)
class RelativeProbeResult:
    """Where the engine's probe logprobs lie on the line from the previous version's (0) to the new one's (1).

    `shown` = <engine - old, new - old> / |new - old|^2 (1: the engine shows the whole update, 0: it shows none).
    `separation` = 2 shown - 1 = (|e - old|^2 - |e - new|^2) / |new - old|^2: > 0 iff the engine is nearer the new
    weights than the old (1 synced, -1 stale). `inconclusive`: the update's probe norm is under `min_update_sigmas`
    noise standard deviations, so noise alone could move `shown` past 1/2 (rely on the engine-side evidence).
    """

    shown: float
    separation: float
    update_l2: float  # |new - old| over all probe tokens
    max_update: float  # max per-token |new - old|
    engine_old_max_abs_diff: float
    inconclusive: bool


def relative_probe(
    engine_logprobs: list[list[float]],
    new_logprobs: list[list[float]],
    old_logprobs: list[list[float]],
    noise_rms: float,
    min_update_sigmas: float = 6.0,
) -> RelativeProbeResult:
    """Project the engine's probe logprobs onto the update (old -> new trainer logprobs); see `RelativeProbeResult`.

    With per-token noise of rms `noise_rms`, `shown` has noise std `noise_rms / update_l2`; requiring
    `update_l2 >= min_update_sigmas * noise_rms` keeps the pass threshold (1/2) 3 std from both 0 and 1 at the default.
    """
    e, n, o = (_flat(x) for x in (engine_logprobs, new_logprobs, old_logprobs))
    if not len(e) == len(n) == len(o):
        raise WeightSyncError(f"weight-sync probe: {len(e)} engine, {len(n)} new and {len(o)} old logprobs")
    upd = [b - a for a, b in zip(o, n, strict=True)]
    upd_sq = sum(u * u for u in upd)
    dot = sum((x - a) * u for x, a, u in zip(e, o, upd, strict=True))
    update_l2 = upd_sq**0.5
    shown = dot / upd_sq if upd_sq > 0 else float("nan")
    return RelativeProbeResult(
        shown=shown,
        separation=2 * shown - 1,
        update_l2=update_l2,
        max_update=max((abs(u) for u in upd), default=0.0),
        engine_old_max_abs_diff=max((abs(x - a) for x, a in zip(e, o, strict=True)), default=0.0),
        inconclusive=not update_l2 >= min_update_sigmas * noise_rms or shown != shown,
    )


def check_relative_probe(result: RelativeProbeResult, engine: str, version: int, previous: int) -> None:
    """Raise `WeightSyncError` when a conclusive probe shows the engine nearer `previous`'s weights than `version`'s."""
    if result.inconclusive or result.shown >= 0.5:
        return
    raise WeightSyncError(
        f"rollout engine {engine} still serves (or mostly serves) version {previous}'s weights after syncing version "
        f"{version}: its probe logprobs show {result.shown:.3g} of the update (1 = synced, 0 = stale; separation "
        f"{result.separation:.3g}, update |new-old| {result.update_l2:.3g}, max {result.max_update:.3g}; max "
        f"|engine-old| {result.engine_old_max_abs_diff:.3g}). The load did not take effect."
    )


def default_probe_noise(tolerance: float) -> float:
    """Per-token rms noise the relative check assumes: a quarter of the absolute tolerance (which bounds the max).

    Conservative: float32 engines measure ~1e-6 against the trainer's 2.5e-4 assumed here."""
    return tolerance / 4


def _flat(logprobs: list[list[float]]) -> list[float]:
    return [float(x) for seq in logprobs for x in seq]
