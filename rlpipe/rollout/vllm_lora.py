"""vLLM serving a LoRA policy: the server holds the base model, and every update loads only the adapter.

The managed server starts with `--enable-lora` (`lora_server_args`) and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`
(runtime adapter loading). A sync publishes a peft adapter directory (megabytes: `write_adapter_dir`) and loads
it under a new name per weight version (`policy-lora-v00000042`, `POST /v1/load_lora_adapter`); from then on
sampling and the probe's `score` name that adapter as the request's `model`, and the previous version is unloaded.
So the probe is scored through the adapter on the engine side: an engine that kept the previous adapter, or that
answers with the base model, fails the probe (`EngineSync.verify`) instead of sampling off-policy.
"""

from __future__ import annotations

from rlpipe.errors import RolloutServerError
from rlpipe.rollout.http_json import request_raw
from rlpipe.rollout.vllm_engine import VLLMEngine

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's allowed --max-lora-rank values
LORA_SERVER_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def lora_server_args(rank: int) -> list[str]:
    """Server flags for serving adapters of rank `rank`: the smallest allowed max rank that holds it, and two
    adapter slots (the new version is loaded before the previous one is unloaded)."""
    max_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
    if max_rank is None:
        raise ValueError(f"model.lora.rank={rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")
    return ["--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", "2"]


def adapter_name(base_name: str, version: int) -> str:
    """The served name of the adapter of weight version `version` (what requests put in `model`)."""
    return f"{base_name}-lora-v{version:08d}"


class VLLMLoRAEngine(VLLMEngine):
    """A `VLLMEngine` whose `load_weights` loads a peft adapter directory beside the base model."""

    def __init__(self, base_url, model_name: str, eos_token_id, server=None, **kwargs):
        super().__init__(base_url, model_name, eos_token_id, server=server, **kwargs)
        self.base_model_name = model_name  # the server's own model; `model_name` becomes the current adapter's

    def load_weights(self, serving_dir: str | None, version: int) -> None:
        """Load the adapter in `serving_dir` as `adapter_name(version)` (in place if that name is loaded), point
        requests at it, unload the previous adapter. Unverified until the caller's probe passes."""
        if serving_dir is None:
            raise RolloutServerError(f"{self.name}: a LoRA sync needs an adapter directory (weight_sync.method=disk)")
        name, previous = adapter_name(self.base_model_name, version), self.model_name
        body = {"lora_name": name, "lora_path": str(serving_dir), "load_inplace": True}
        request_raw(self._url("/v1/load_lora_adapter"), body, self.timeout_s)
        self.model_name = name
        if previous not in (name, self.base_model_name):
            request_raw(self._url("/v1/unload_lora_adapter"), {"lora_name": previous}, self.timeout_s)
        self.served_version, self.served_dir = version, str(serving_dir)

    def restart(self) -> None:
        """Restart the managed server from the base model and reload the last adapter (unverified until probed)."""
        if self.server is None:
            raise RolloutServerError(f"{self.name} is not managed by rlpipe; cannot restart it")
        adapter_dir, version = self.served_dir, self.served_version
        self.server.start()
        self.model_name = self.base_model_name
        if adapter_dir is not None and version is not None:
            self.load_weights(adapter_dir, version)
        self.served_version = None
