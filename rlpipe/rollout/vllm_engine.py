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

from rlpipe.errors import RolloutServerError, WeightSyncError
from rlpipe.rollout.engine import Generation, SamplingParams
from rlpipe.rollout.http_json import request_json
from rlpipe.rollout.openai_engine import OpenAIRolloutEngine
from rlpipe.rollout.vllm_process import VLLMServer
from rlpipe.rollout.weight_evidence import (
    check_checksums_moved,
    engine_param_name,
    observable_names,
    published_digests,
    published_names,
    strip_rank,
)


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
        check_checksums: bool = True,
        published_dtype: str = "float32",
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
        self.check_checksums = check_checksums  # `/weight_checker` after every disk load (issue 33)
        self.published_dtype = published_dtype
        self.last_check_s = 0.0  # seconds of the last load spent on the engine-side evidence
        self.last_check_metrics: dict[str, float] = {}
        self._digests: dict[str, dict[str, str]] = {}  # published tensor digests per serving dir (newest two)
        self._engine_checksums: dict[str, str] | None = None  # the engine's after the last verified load

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
    def _client(self) -> OpenAIRolloutEngine:
        return OpenAIRolloutEngine(
            self.base_url, self.model_name, timeout_s=self.timeout_s, max_retries=self.max_retries,
            eos_token_id=self.eos_token_id, max_concurrency=16,
        )  # fmt: skip

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        return self._client().generate(prompts, params)

    def generate_each(self, prompts: list[list[int]], params: SamplingParams, indices: list[int]):
        """Per-prompt results and failures (`OpenAIRolloutEngine.generate_each`): what a replica pool re-sends."""
        return self._client().generate_each(prompts, params, indices)

    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Logprob of each response token under the served weights, from `prompt_logprobs` (raw logits, T=1)."""
        return self.score_many([(prompt_ids, response_ids)])[0]

    def score_many(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """`score` of every (prompt, response) pair in one request: the server batches them, so a probe of several
        sequences costs one round trip and one forward instead of one each."""
        body = {"model": self.model_name, "prompt": [list(p) + list(r) for p, r in sequences], "max_tokens": 1,
                "temperature": 0.0, "prompt_logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
        answer = request_json(self._url("/v1/completions"), body, self.timeout_s)
        try:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            if len(choices) != len(sequences):
                raise IndexError(f"{len(choices)} choices for {len(sequences)} sequences")
            return [
                [_logprob_of(choice["prompt_logprobs"][len(p) + j], tok) for j, tok in enumerate(r)]
                for choice, (p, r) in zip(choices, sequences, strict=True)
            ]
        except (KeyError, IndexError, TypeError) as e:
            raise RolloutServerError(f"{self.name}: malformed prompt_logprobs answer ({e}): {answer!r:.300}") from e

    # ------------------------------------------------------------------ weights
    def load_weights(self, serving_dir: str | None, version: int) -> None:
        """Pause, reload `serving_dir` in place, drop cached KV, tag the version, resume (also on failure); then
        check the engine's evidence (`_check_load`): the version it reports and the checksums that moved.

        `serving_dir=None`: the weights were already streamed (NCCL path, which pauses and resumes itself)."""
        start = time.perf_counter()
        self.last_check_s, self.last_check_metrics = 0.0, {}
        if serving_dir is None:
            self.served_version, self.last_load_s = version, 0.0
            return
        before = self._engine_checksums
        if before is None and self.check_checksums:
            before = self.weight_checksums()
        self._engine_checksums = None
        self.served_version = None  # unverified until the checks below and the caller's probe pass
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
        previous_dir, self.served_dir = self.served_dir or self._start_dir(), str(serving_dir)
        self._check_load(version, before, previous_dir)
        self.served_version = version
        self.last_load_s = time.perf_counter() - start

    def _check_load(self, version: int, before: dict[str, str] | None, previous_dir: str | None) -> None:
        """The version read back equals `version`; the checksums of exactly the updated parameters moved."""
        start = time.perf_counter()
        reported = self.reported_version()
        if reported != str(version):
            raise WeightSyncError(f"rollout engine {self.name} reports weight version {reported!r} after loading "
                                  f"version {version}: the load did not complete")  # fmt: skip
        if self.check_checksums and before is not None:
            after = self.weight_checksums()
            diff = self._published_diff(previous_dir, before)
            if diff is not None:
                changed, unchanged, unobservable = diff
                strict = self.published_dtype == (self.server.spec.dtype if self.server else self.published_dtype)
                self.last_check_metrics = check_checksums_moved(
                    before, after, changed, unchanged, self.name, version, strict
                )
                # not hashed, so not in `changed`: counted here (vLLM CPU's packed linear weights)
                hidden = {engine_param_name(n) for n in unobservable} & strip_rank(after).keys()
                self.last_check_metrics["engine/checksum_params_unobservable"] = float(len(hidden))
            self._engine_checksums = after
            self._digests = {k: v for k, v in self._digests.items() if k == self.served_dir}
        self.last_check_s = time.perf_counter() - start

    def _published_diff(self, previous_dir: str | None, before: dict[str, str]):
        """(changed, unchanged, unobservable) HF tensor names between the previous and the served directory,
        hashing only tensors whose engine checksum can move; None when either directory cannot be read."""
        try:
            names = published_names(self.served_dir)
        except OSError:
            return None
        observable = observable_names(names, before)
        new = self._published(self.served_dir, observable)
        old = self._published(previous_dir, observable) if previous_dir else None
        if new is None or old is None:
            return None
        changed = {n for n, d in new.items() if n in old and old[n] != d}
        if "lm_head.weight" not in new and "model.embed_tokens.weight" in changed:
            changed.add("lm_head.weight")  # a tied head follows the embedding (unmapped if vLLM shares it)
        unchanged = {n for n, d in new.items() if old.get(n) == d}
        return changed, unchanged, set(names) - observable

    def _published(self, serving_dir: str, names: set[str]) -> dict[str, str] | None:
        if serving_dir not in self._digests:
            try:
                self._digests[serving_dir] = published_digests(serving_dir, names)
            except (OSError, FileNotFoundError):
                return None  # e.g. the previous directory was pruned: nothing to diff against
        return self._digests[serving_dir]

    def _start_dir(self) -> str | None:
        return self.server.spec.model_dir if self.server is not None else None

    def control_endpoint(self):
        """How trainer rank 0 reaches this server's admin routes for the NCCL transfer (`nccl_transfer`)."""
        from rlpipe.rollout.nccl_transfer import HttpControl

        return HttpControl(self.base_url)

    def weight_checksums(self) -> dict[str, str]:
        """sha256 of every engine parameter per rank (`/weight_checker`, vLLM dev mode)."""
        return request_json(self._url("/weight_checker"), {"action": "checksum"}, self.timeout_s)["checksums"]

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
        self._engine_checksums = None  # a new process: read its checksums afresh before the next load
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
