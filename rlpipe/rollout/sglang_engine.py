"""SGLang as a `SyncableEngine`: sampling over its OpenAI-compatible `/v1/completions`, weights from disk.

A load is `POST /update_weights_from_disk {"model_path": DIR, "load_format": "auto", "weight_version": "v"}`
(SGLang pauses scheduling while it loads, and answers `{"success": bool, "message": str}`), then
`POST /flush_cache` (the radix cache holds KV of the old weights). Scoring for the probe uses the native
`/generate` with `input_ids`, `return_logprob` and `logprob_start_len`, whose `meta_info.input_token_logprobs` are
`[logprob, token_id, text]` per input position (the first is null).
"""

from __future__ import annotations

import time
from typing import Any

from rlpipe.errors import RolloutServerError
from rlpipe.rollout.engine import Generation, SamplingParams
from rlpipe.rollout.http_json import request_json
from rlpipe.rollout.openai_engine import OpenAIRolloutEngine


class SGLangEngine:
    """An SGLang server at `base_url` (not managed: rlpipe does not start or restart it)."""

    restartable = False

    def __init__(self, base_url: str, model_name: str, eos_token_id: int | None, timeout_s: float = 300.0):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model_name = model_name
        self.eos_token_id = eos_token_id
        self.timeout_s = timeout_s
        self.served_version: int | None = None
        self.served_dir: str | None = None
        self.last_load_s = 0.0

    @property
    def name(self) -> str:
        return f"sglang {self.base_url}"

    def _client(self) -> OpenAIRolloutEngine:
        return OpenAIRolloutEngine(self.base_url, self.model_name, timeout_s=self.timeout_s, max_retries=1,
                                   eos_token_id=self.eos_token_id)  # fmt: skip

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        return self._client().generate(prompts, params)

    def generate_each(self, prompts: list[list[int]], params: SamplingParams, indices: list[int]):
        """Per-prompt results and failures (`OpenAIRolloutEngine.generate_each`)."""
        return self._client().generate_each(prompts, params, indices)

    @staticmethod
    def load_body(serving_dir: str, version: int) -> dict[str, Any]:
        return {"model_path": str(serving_dir), "load_format": "auto", "weight_version": str(version)}

    @staticmethod
    def score_body(prompt_ids: list[int], response_ids: list[int]) -> dict[str, Any]:
        return {
            "input_ids": list(prompt_ids) + list(response_ids),
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }

    def load_weights(self, serving_dir: str, version: int) -> None:
        start = time.perf_counter()
        answer = request_json(self.base_url + "/update_weights_from_disk", self.load_body(serving_dir, version),
                              self.timeout_s)  # fmt: skip
        if not answer.get("success", False):
            raise RolloutServerError(f"{self.name}: update_weights_from_disk({serving_dir}) failed: {answer!r:.300}")
        request_json(self.base_url + "/flush_cache", {}, self.timeout_s)
        self.served_version, self.served_dir = version, str(serving_dir)
        self.last_load_s = time.perf_counter() - start

    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        answer = request_json(self.base_url + "/generate", self.score_body(prompt_ids, response_ids), self.timeout_s)
        try:
            per_position = answer["meta_info"]["input_token_logprobs"]
            out = []
            for j, tok in enumerate(response_ids):
                logprob, token_id = per_position[len(prompt_ids) + j][:2]
                if int(token_id) != int(tok):
                    raise ValueError(f"position {len(prompt_ids) + j} holds token {token_id}, expected {tok}")
                out.append(float(logprob))
            return out
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise RolloutServerError(f"{self.name}: malformed input_token_logprobs ({e}): {answer!r:.300}") from e

    def alive(self) -> bool:
        return True

    def restart(self) -> None:
        raise RolloutServerError(f"{self.name} is not managed by rlpipe; restart it and resume the run")

    def close(self) -> None:
        """Nothing to stop: the server belongs to whoever started it."""
