"""The rollout contract: sampling parameters in, token ids + per-token logprobs out.

Engines are token-in/token-out (prompts are token ids, never text) so the trainer scores exactly the tokens
that were sampled. ``Generation.logprobs[j]`` is ``log_softmax(logits / T)`` of response token ``j`` at the sampling
temperature ``T`` (1 for greedy), before top-p/top-k: the distribution the trainer recomputes, so the on-policy
mismatch is ~0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from rlpipe.errors import ConfigError

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass
class SamplingParams:
    """How to sample ``n`` responses per prompt.

    temperature == 0 means greedy; top_k == 0 and top_p == 1 disable those filters. ``stop_token_ids`` are
    extra stop tokens besides the engine's EOS. ``seed`` makes sampling reproducible for the same inputs.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ConfigError(f"sampling: n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ConfigError(f"sampling: temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"sampling: top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"sampling: max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        """True when sampling degenerates to argmax."""
        return self.temperature == 0


@dataclass
class Generation:
    """One sampled response; ``len(logprobs) == len(response_ids)``; the response ends at its first stop token."""

    prompt_index: int
    sample_index: int
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


@runtime_checkable
class RolloutEngine(Protocol):
    """Anything that samples responses for token-id prompts (HF generate, a vLLM/SGLang server)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Return ``len(prompts) * params.n`` generations ordered by (prompt_index, sample_index)."""
        ...


def truncate_at_stop(
    token_ids: list[int], logprobs: list[float], stop_ids: set[int], eos_token_id: int | None = None
) -> tuple[list[int], list[float], str]:
    """Cut a response after its first stop token (kept); finish_reason is "stop" if one was found, else "length".

    An empty response (a server may return none) becomes ``[eos]`` with logprob 0, so every row has a label.
    """
    for j, tok in enumerate(token_ids):
        if tok in stop_ids:
            return list(token_ids[: j + 1]), list(logprobs[: j + 1]), FINISH_STOP
    if not token_ids and eos_token_id is not None:
        return [eos_token_id], [0.0], FINISH_STOP
    return list(token_ids), list(logprobs), FINISH_LENGTH
