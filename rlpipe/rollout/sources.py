"""Where a run's rollouts come from: one `RolloutSource` per `rollout.engine`, built once by `build_rollout_source`.

Every source has the same `generate(prompts, params, version) -> (generations, engine/* metrics)` and `close()`;
`version` is the policy's weight version (its optimizer step). This module and config validation are the only
readers of `rollout.engine`.

- `hf`: HF `generate` inside the training workers, on a copy of the current weights (`WorkerRollout`);
- `openai`: any OpenAI-compatible server, never synced (`UnsyncedServerRollout`): accepted only with rollout IS on
  (config validation), and its metrics say how many optimizer steps the served weights lag behind;
- `vllm`, `sglang`: a server kept serving the current weights (`SyncedServerRollout` over a `ReplicaPool` of `EngineSync`s, one per replica): the policy is
  published through the training workers (`export_serving`, or NCCL) and every load is verified with a probe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from rlpipe.config import PipelineConfig
from rlpipe.data.packing import SequenceItem, pack_sequences, scatter_to_rows
from rlpipe.io import inside_root
from rlpipe.rollout.engine import Generation, SamplingParams
from rlpipe.rollout.engine_sync import EngineSync
from rlpipe.rollout.probe import ProbeSequence, build_probe, default_probe_tolerance
from rlpipe.rollout.replicas import ReplicaPool

SERVED_MODEL_NAME = "policy"
EngineRows = tuple[list[Generation], dict[str, float]]


class RolloutSource(Protocol):
    """What the session samples from."""

    lineage_name: str | None  # recorded in the manifest's `served` list; None: the trainer's own weights
    sync: ReplicaPool | None  # the synced engines (the pipelined loop drives its syncs); None if not synced

    def generate(self, prompts: list[list[int]], params: SamplingParams, version: int) -> EngineRows: ...

    def close(self) -> None: ...


class WorkerRollout:
    """rollout.engine = hf: each training worker samples its slice of the prompts from the current weights."""

    lineage_name = None
    sync = None

    def __init__(self, controller):
        self.controller = controller

    def generate(self, prompts: list[list[int]], params: SamplingParams, version: int) -> EngineRows:
        return self.controller.generate(prompts, params), {}

    def close(self) -> None:
        """The workers belong to the session."""


class UnsyncedServerRollout:
    """rollout.engine = openai: a server that serves the weights it was started with, whatever the trainer does."""

    sync = None

    def __init__(self, engine, url: str):
        self.engine = engine
        self.lineage_name = f"openai {url}"

    def generate(self, prompts: list[list[int]], params: SamplingParams, version: int) -> EngineRows:
        # never synced: it serves its own weights, `version` optimizer steps behind
        return self.engine.generate(prompts, params), {
            "engine/weight_version": -1.0,
            "engine/weight_lag": float(version),
        }

    def close(self) -> None:
        """The server is the user's."""


class SyncedServerRollout:
    """rollout.engine = vllm | sglang: servers brought to `version` (published, loaded, probed) before they sample."""

    def __init__(self, sync: ReplicaPool):
        self.sync = sync

    @property
    def lineage_name(self) -> str:
        return self.sync.name  # every live replica's address (a restarted one may have a new port)

    def generate(self, prompts: list[list[int]], params: SamplingParams, version: int) -> EngineRows:
        gens = self.sync.generate(prompts, params, version)
        return gens, self.sync.stats.row(self.sync.served_version)

    def close(self) -> None:
        self.sync.close()


def build_rollout_source(
    cfg: PipelineConfig, model_dir: str, controller, tokenizer, prompts, log=print
) -> RolloutSource:
    """The source `rollout.engine` names; a managed vLLM server is started here."""
    r = cfg.rollout
    if r.engine == "hf":
        return WorkerRollout(controller)
    if r.engine == "openai":
        from rlpipe.rollout.openai_engine import OpenAIRolloutEngine

        engine = OpenAIRolloutEngine(r.server_url, r.server_model or "default", eos_token_id=tokenizer.eos_token_id)
        return UnsyncedServerRollout(engine, r.server_url)
    return SyncedServerRollout(build_engine_sync(cfg, model_dir, controller, tokenizer, prompts, log))


def serving_root(cfg: PipelineConfig) -> Path:
    """Where published weights go (the server reads them): `weight_sync.dir`, else `<output_dir>/serving/<exp>`."""
    sync = cfg.rollout.weight_sync
    return Path(sync.dir) if sync.dir else inside_root(cfg.output_dir, "serving", cfg.experiment)


def build_engine_sync(cfg: PipelineConfig, model_dir: str, controller, tokenizer, prompts, log=print) -> ReplicaPool:
    """The verified, lazily synced engine replicas of rollout.engine = vllm or sglang."""
    r = cfg.rollout
    streamed = r.weight_sync.method == "nccl"
    engines, publish = _engines(cfg, model_dir, controller, tokenizer.eos_token_id, log)
    if streamed:
        publish = _nccl_publisher(controller, engines, r.weight_sync.bucket_mb << 20)
    probe = build_probe(
        [prompts[i].prompt_ids for i in range(min(len(prompts), r.weight_sync.probe_sequences))],
        vocab_size=len(tokenizer),
        num_sequences=r.weight_sync.probe_sequences,
        response_length=r.max_new_tokens,
        seed=cfg.data.seed,
    )
    tolerance = r.weight_sync.probe_tolerance or default_probe_tolerance(cfg.model.dtype)
    max_restarts = cfg.rollout.vllm.max_restarts if r.engine == "vllm" else 0
    syncs = [
        EngineSync(engine, publish=None, trainer_probe=None, probe=probe, tolerance=tolerance,  # the pool publishes
                   max_restarts=max_restarts, log=log, publish_ahead=not streamed)
        for engine in engines
    ]  # fmt: skip
    return ReplicaPool(
        syncs,
        publish=publish,
        trainer_probe=lambda seqs: trainer_probe_logprobs(cfg, controller, tokenizer.pad_token_id, seqs),
        probe=probe,
        max_new_tokens=r.max_new_tokens,
        publish_ahead=not streamed,  # a new versioned directory never touches the served one
        rejoinable=not streamed,  # a restarted server is outside the trainer's NCCL group
        log=log,
    )


def _engines(cfg: PipelineConfig, model_dir: str, controller, eos_token_id: int | None, log):
    """(engines, publish): managed replicas in Ray actors fed through the object store, or servers that read the
    serving directory (the one managed server beside the driver, or the user's at server_url(s))."""
    r = cfg.rollout
    name = r.server_model or SERVED_MODEL_NAME
    urls = list(r.server_urls) or ([r.server_url] if r.server_url else [])
    if r.engine == "sglang":
        from rlpipe.rollout.sglang_engine import SGLangEngine

        engines = [SGLangEngine(url, name, eos_token_id) for url in urls]
    elif urls:
        engines = [_vllm_engine_class(cfg)(url, name, eos_token_id) for url in urls]
    elif r.vllm.replicas > 1 or r.vllm.resources:
        from rlpipe.rollout.replica_actor import start_replicas

        spec = managed_server_spec(cfg, model_dir, name, on_gpu="GPU" in r.vllm.resources)
        engines = start_replicas(spec, model_dir, r.vllm, eos_token_id, cfg.model.dtype, log, cfg.model.lora.enabled)
        return engines, lambda version: controller.export_serving_ref()  # no disk: the object store
    else:
        engines = [_managed_vllm_engine(cfg, model_dir, name, eos_token_id, log)]
    return engines, _disk_publisher(controller, serving_root(cfg))


def _disk_publisher(controller, root: Path):
    """Publish = the workers write a serving directory; the engine reloads it."""
    return lambda version: controller.export_serving(str(root.resolve()), version)


def _nccl_publisher(controller, engines, bucket_bytes: int):
    """Publish = the workers stream the weights into every server over one NCCL group; nothing to load after."""
    controller.init_weight_transfer([engine.control_endpoint() for engine in engines])

    def publish(version: int) -> None:
        controller.send_weights_nccl(version, bucket_bytes)
        return None

    return publish


def _managed_vllm_engine(cfg: PipelineConfig, model_dir: str, name: str, eos_token_id: int | None, log):
    """The one managed vLLM server, a child process of the driver on its host."""
    import torch

    from rlpipe.rollout.vllm_process import VLLMServer

    server = VLLMServer(managed_server_spec(cfg, model_dir, name, on_gpu=torch.cuda.is_available()), log=log)
    server.start()
    return _vllm_engine_class(cfg)(None, name, eos_token_id, server=server)


def _vllm_engine_class(cfg: PipelineConfig):
    """VLLMEngine, or with LoRA the engine whose syncs load only the adapter."""
    from rlpipe.rollout.vllm_engine import VLLMEngine
    from rlpipe.rollout.vllm_lora import VLLMLoRAEngine

    return VLLMLoRAEngine if cfg.model.lora.enabled else VLLMEngine


def managed_server_spec(cfg: PipelineConfig, model_dir: str, name: str, on_gpu: bool):
    """How rlpipe starts its own vLLM server for this config (`rollout.vllm.*`); on CPU, with `cpu_server_args`
    first (the user's `extra_args` come after them, so theirs win)."""
    from rlpipe.rollout.vllm_lora import LORA_SERVER_ENV, lora_server_args
    from rlpipe.rollout.vllm_process import VLLMServerSpec, check_cpu_head_dim, cpu_server_args, resolve_vllm_python

    r, v, lora = cfg.rollout, cfg.rollout.vllm, cfg.model.lora
    max_model_len = v.max_model_len or cfg.data.max_prompt_length + r.max_new_tokens
    if not on_gpu:
        check_cpu_head_dim(str(Path(model_dir).resolve()))
    return VLLMServerSpec(
        python=resolve_vllm_python(v.python),
        model_dir=str(Path(model_dir).resolve()),
        served_model_name=name,
        host=v.host,
        port=v.port,
        dtype=cfg.model.dtype,
        max_model_len=max_model_len,
        kv_cache_gib=v.kv_cache_gib,
        gpu_memory_utilization=v.gpu_memory_utilization,
        extra_args=([] if on_gpu else cpu_server_args(max_model_len))
        + (lora_server_args(lora.rank) if lora.enabled else [])
        + list(v.extra_args)
        + (["--weight-transfer-config", '{"backend": "nccl"}'] if r.weight_sync.method == "nccl" else []),
        extra_env=dict(LORA_SERVER_ENV) if lora.enabled else {},
        log_path=str(Path(cfg.output_dir).resolve() / "logs" / f"vllm-{cfg.experiment}.log"),
        startup_timeout_s=v.startup_timeout_s,
    )


def trainer_probe_logprobs(
    cfg: PipelineConfig, controller, pad_token_id: int, probe: list[ProbeSequence]
) -> list[list[float]]:
    """The trainer's logprobs (temperature 1) of every probe response token, through the same packed forward as
    old logprobs."""
    items = [SequenceItem(p.prompt_ids, p.response_ids, row=i) for i, p in enumerate(probe)]
    packs = pack_sequences(items, cfg.train.pack_max_length, pad_token_id, cfg.dp_size, pad_to_max_length=False)
    values = controller.compute_logprobs(packs, temperature=1.0)
    return scatter_to_rows(packs, values, len(items))
