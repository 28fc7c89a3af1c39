"""vLLM as a `SyncableEngine`: sampling over `/v1/completions`, weight loads over vLLM's admin routes.

A load from disk is `POST /pause?mode=wait` (in-flight requests finish on the old weights, new ones wait),
`POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}` (in place, every worker),
`POST /reset_prefix_cache` (KV cached for the old weights must not be reused), `POST /update_weight_version`
(the server reports what it serves in `/weight_info`), then `POST /resume` — in `finally`, so a failed load never
leaves the server paused. The GPU path without a disk round trip is `rlpipe.rollout.nccl_transfer`.

Logprobs: the managed server runs with `--logprobs-mode processed_logprobs`, i.e. of the distribution that was
sampled (logits / temperature), as the trainer scores them. `score` uses `prompt_logprobs`, computed from the raw
logits (temperature 1): the probe compares weights, not sampling settings.
"""

from __future__ import annotations

import time

from rlpipe.errors import RolloutServerError
from rlpipe.rollout.engine import Generation, SamplingParams
from rlpipe.rollout.http_json import request_json
from rlpipe.rollout.openai_engine import OpenAIRolloutEngine
from rlpipe.rollout.vllm_process import VLLMServer


class VLLMEngine:
    """A vLLM server, managed by rlpipe (`server` given: it can be restarted) or reached at `base_url`."""

    def __init__(
        self,
        base_url: str | None,
        model_name: str,
        eos_token_id: int | None,
        server: VLLMServer | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 1,
    ):
        if server is None and not base_url:
            raise RolloutServerError("VLLMEngine needs a base_url or a managed server")
        self.server = server
        self._base_url = base_url
        self.model_name = model_name
        self.eos_token_id = eos_token_id
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.served_version: int | None = None
        self.served_dir: str | None = None
        self.last_load_s = 0.0

    # ------------------------------------------------------------------ identity
    @property
    def base_url(self) -> str:
        return self.server.base_url if self.server is not None else str(self._base_url).rstrip("/")

    @property
    def name(self) -> str:
        return f"vllm {self.base_url}"

    def _url(self, route: str) -> str:
        return self.base_url + route

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        client = OpenAIRolloutEngine(
            self.base_url, self.model_name, timeout_s=self.timeout_s, max_retries=self.max_retries,
            eos_token_id=self.eos_token_id, max_concurrency=16,
        )  # fmt: skip
        return client.generate(prompts, params)

    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Logprob of each response token under the served weights, from `prompt_logprobs` (raw logits, T=1)."""
        ids = list(prompt_ids) + list(response_ids)
        body = {"model": self.model_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
        answer = request_json(self._url("/v1/completions"), body, self.timeout_s)
        try:
            per_position = answer["choices"][0]["prompt_logprobs"]
            return [_logprob_of(per_position[len(prompt_ids) + j], tok) for j, tok in enumerate(response_ids)]
        except (KeyError, IndexError, TypeError) as e:
            raise RolloutServerError(f"{self.name}: malformed prompt_logprobs answer ({e}): {answer!r:.300}") from e

    # ------------------------------------------------------------------ weights
    def load_weights(self, serving_dir: str | None, version: int) -> None:
        """Pause, reload `serving_dir` in place, drop cached KV, tag the version, resume (also on failure).

        `serving_dir=None`: the weights were already streamed (NCCL path, which pauses and resumes itself)."""
        start = time.perf_counter()
        if serving_dir is None:
            self.served_version, self.last_load_s = version, 0.0
            return
        request_json(self._url("/pause?mode=wait"), {}, self.timeout_s)
        try:
            request_json(
                self._url("/collective_rpc"),
                {"method": "reload_weights", "kwargs": {"weights_path": str(serving_dir)}},
                self.timeout_s,
            )
            request_json(self._url("/reset_prefix_cache"), {}, self.timeout_s)
            request_json(self._url("/update_weight_version"), {"new_version": str(version)}, self.timeout_s)
        finally:
            request_json(self._url("/resume"), {}, self.timeout_s)
        self.served_version, self.served_dir = version, str(serving_dir)
        self.last_load_s = time.perf_counter() - start

    def reported_version(self) -> str | None:
        """What the server says it serves (`/weight_info`), for the Deck and lineage."""
        try:
            return request_json(self._url("/weight_info"), None, 10.0, method="GET").get("weight_version")
        except RolloutServerError:
            return None

    # ------------------------------------------------------------------ lifecycle
    @property
    def restartable(self) -> bool:
        return self.server is not None

    def alive(self) -> bool:
        return self.server.alive() if self.server is not None else True

    def restart(self) -> None:
        """Restart the managed server from the last loaded weights (or the model it started with)."""
        if self.server is None:
            raise RolloutServerError(f"{self.name} is not managed by rlpipe; cannot restart it")
        self.server.start(self.served_dir)
        self.served_version = None  # unverified until the caller's probe passes

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


def _logprob_of(entry: dict | None, token: int) -> float:
    """vLLM's prompt_logprobs entry for one position: {"<id>" or "token_id:<id>": {"logprob": x, ...}, ...}."""
    if not entry:
        raise KeyError(f"no prompt logprob for token {token}")
    hit = entry.get(str(token)) or entry.get(f"token_id:{token}")
    if hit is None:
        raise KeyError(f"token {token} missing from prompt_logprobs entry {list(entry)[:4]}")
    return float(hit["logprob"])
