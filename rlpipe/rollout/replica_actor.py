"""One managed vLLM replica on its own Ray node: the `EngineReplica` actor, and `RemoteEngine`, its driver-side handle.

Ray (KubeRay) places the actor by `rollout.vllm.resources` (one GPU, or a custom resource of the engine worker
group). The actor starts the server process on its node and keeps everything it needs there: the base model and
every weight version arrive through Ray's object store and are written to a node-local directory (memory-backed
`/dev/shm` when there is one), so no filesystem is shared between the driver, the trainer and the engines.
`RemoteEngine` is the `SyncableEngine` that `EngineSync` drives: load, score, generate, restart, each one actor call.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

from rlpipe.errors import RolloutServerError
from rlpipe.rollout.engine import Generation, SamplingParams
from rlpipe.rollout.vllm_process import VLLMServerSpec


def node_local_root() -> Path:
    """Where a replica keeps its weights: `/dev/shm` (memory-backed) if writable, else the temp directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class EngineReplica:
    """The Ray actor: a `VLLMEngine` whose server runs on this actor's node, fed from the object store."""

    def __init__(self, spec: VLLMServerSpec, base_files: dict[str, bytes], index: int, eos_token_id: int | None,
                 published_dtype: str = "float32", lora: bool = False):  # fmt: skip
        import ray

        from rlpipe.rollout.serving_dir import write_files
        from rlpipe.rollout.vllm_engine import VLLMEngine
        from rlpipe.rollout.vllm_lora import VLLMLoRAEngine
        from rlpipe.rollout.vllm_process import VLLMServer

        self.node_id = ray.get_runtime_context().get_node_id()
        self.root = node_local_root() / f"rlpipe-replica{index}-{uuid.uuid4().hex[:8]}"
        base = self.root / "base"
        base.mkdir(parents=True)
        write_files(base_files, base)
        spec.model_dir, spec.log_path = str(base), str(self.root / "vllm.log")
        self.server = VLLMServer(spec, log=lambda m: print(f"[replica {index}] {m}", flush=True))
        engine_cls = VLLMLoRAEngine if lora else VLLMEngine  # LoRA: every sync loads only the adapter
        self.engine = engine_cls(None, spec.served_model_name, eos_token_id, server=self.server,
                                 published_dtype=published_dtype)  # fmt: skip
        self.server.start()

    def describe(self) -> dict[str, str]:
        return {"node_id": self.node_id, "url": self.server.base_url, "root": str(self.root)}

    def load(self, weights, version: int) -> dict[str, Any]:
        """Write `weights` (a `serving_buffer` array, read in place from the object store, or any bytes-like
        safetensors file; with LoRA the adapter directory's files by name) as this node's copy of `version` and
        load it (a path: load that; None: the trainer streamed it over NCCL)."""
        from rlpipe.rollout.serving_dir import write_serving_buffer, write_version_files

        size = 0
        if isinstance(weights, dict):
            size = sum(len(data) for data in weights.values())
            weights = str(write_version_files(weights, self.root / "adapters", version))
        elif weights is not None and not isinstance(weights, str):  # None: already in the server, nothing to write
            size = memoryview(weights).nbytes
            weights = str(write_serving_buffer(weights, self.root / "base", self.root / "serving", version))
        self.engine.load_weights(weights, version)
        return {"served_dir": weights, "check_s": self.engine.last_check_s, "checks": self.engine.last_check_metrics,
                "bytes": size}  # fmt: skip

    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        return self.engine.score(prompt_ids, response_ids)

    def score_many(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        return self.engine.score_many(sequences)

    def control(self, route: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
        """One admin call to this node's server, for trainer rank 0's NCCL transfer (the server listens on the
        node's loopback only, so the call goes through this actor)."""
        return self.engine.control_endpoint().call(route, body, method)

    def served_model(self) -> str:
        """The model name requests carry (with LoRA the current version's adapter name)."""
        return self.engine.model_name

    def generate_each(self, prompts: list[list[int]], params: SamplingParams, indices: list[int]):
        return self.engine.generate_each(prompts, params, indices)

    def alive(self) -> bool:
        return self.server.alive()

    def server_pid(self) -> int | None:
        """The server's process id (a fault-injection test kills it)."""
        return self.server.process.pid if self.server.process is not None else None

    def restart(self) -> None:
        self.engine.restart()

    def close(self) -> None:
        import shutil

        self.server.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class RemoteEngine:
    """Driver side of one `EngineReplica`: the `SyncableEngine` an `EngineSync` keeps verified."""

    restartable = True

    def __init__(self, actor, index: int, timeout_s: float = 600.0):
        self.actor = actor
        self.index = index
        self.timeout_s = timeout_s
        self.served_version: int | None = None
        self.served_dir: str | None = None
        self.last_check_s = 0.0
        self.last_check_metrics: dict[str, float] = {}
        self.last_load_bytes = 0  # what the last load pulled through the object store (`engine/sync_bytes`)
        self.where = self._call("describe")
        self.name = f"vllm replica {index} ({self.where['url']} on node {self.where['node_id'][:12]})"

    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """One actor call; a lost actor or node becomes a `RolloutServerError` naming the replica."""
        hint = " (not placed? a node must offer rollout.vllm.num_cpus and rollout.vllm.resources)"
        return call_replica(self.actor, self.index, method, args, timeout_s or self.timeout_s, method, hint)

    def load_weights(self, weights, version: int) -> None:
        self.served_version = None  # unverified until the caller's probe passes
        out = self._call("load", weights, version)
        self.served_dir, self.last_check_s, self.last_check_metrics = out["served_dir"], out["check_s"], out["checks"]
        self.last_load_bytes = out["bytes"]
        self.served_version = version

    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        return self._call("score", prompt_ids, response_ids)

    def score_many(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        return self._call("score_many", sequences)

    def generate_each(self, prompts: list[list[int]], params: SamplingParams, indices: list[int]):
        return self._call("generate_each", prompts, params, indices)

    def control_endpoint(self) -> ReplicaControl:
        return ReplicaControl(self.actor, self.index, self.name)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        done, failed = self.generate_each(prompts, params, list(range(len(prompts))))
        if failed:
            raise RolloutServerError(failed[min(failed)])
        return [g for i in range(len(prompts)) for g in done[i]]

    def alive(self) -> bool:
        try:
            return bool(self._call("alive", timeout_s=30.0))
        except RolloutServerError:
            return False

    def restart(self) -> None:
        self._call("restart")
        self.served_version = None

    def close(self) -> None:
        import ray

        try:
            self._call("close", timeout_s=60.0)
        except RolloutServerError:
            pass
        ray.kill(self.actor)


class ReplicaControl:
    """A managed replica's admin routes as a `nccl_transfer.ControlEndpoint`: each call goes through its actor, so
    trainer rank 0 on another node reaches a server that listens on its own node's loopback."""

    def __init__(self, actor, index: int, name: str, timeout_s: float = 660.0):
        self.actor, self.index, self.name, self.timeout_s = actor, index, name, timeout_s

    def call(self, route: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
        # the actor's own HTTP call times out first (after 600 s), with the server's error
        return call_replica(self.actor, self.index, "control", (route, body, method), self.timeout_s, route)


def call_replica(actor, index: int, method: str, args: tuple, timeout_s: float, what: str, hint: str = "") -> Any:
    """`actor.method(*args)`, awaited; a lost actor or node, or no answer in `timeout_s`, becomes a
    `RolloutServerError` naming replica `index` (and `what` it was asked)."""
    import ray

    from rlpipe.ray_env import lost_worker_errors

    try:
        return ray.get(getattr(actor, method).remote(*args), timeout=timeout_s)
    except lost_worker_errors() as exc:
        raise RolloutServerError(f"vllm replica {index}: its actor or node is gone ({exc})") from exc
    except ray.exceptions.GetTimeoutError as exc:
        raise RolloutServerError(f"vllm replica {index}: no answer to {what} in {timeout_s:.0f}s{hint}") from exc


def start_replicas(spec: VLLMServerSpec, model_dir: str, vllm_cfg, eos_token_id: int | None, dtype: str,
                   log=print, lora: bool = False) -> list[RemoteEngine]:  # fmt: skip
    """Start `vllm_cfg.replicas` replica actors at once, spread over the nodes that have `vllm_cfg.resources`; each
    gets the base model through the object store (`lora`: servers that load a new adapter per sync). Returns once
    every server answers /health."""
    import copy

    import ray

    from rlpipe.rollout.serving_dir import model_dir_files

    resources = dict(vllm_cfg.resources)
    gpus = resources.pop("GPU", 0)
    actor_cls = ray.remote(EngineReplica).options(
        num_cpus=vllm_cfg.num_cpus, num_gpus=gpus, resources=resources or None, scheduling_strategy="SPREAD",
        max_restarts=0,
    )  # fmt: skip
    base = ray.put(model_dir_files(model_dir))
    log(f"starting {vllm_cfg.replicas} vLLM replica actor(s) (resources {vllm_cfg.resources or 'none'})")
    actors = [actor_cls.remote(copy.deepcopy(spec), base, i, eos_token_id, dtype, lora)
              for i in range(vllm_cfg.replicas)]  # fmt: skip
    engines = [RemoteEngine(actor, i, timeout_s=spec.startup_timeout_s + 60) for i, actor in enumerate(actors)]
    for e in engines:
        e.timeout_s = 600.0
        log(f"{e.name}: ready, weights under {e.where['root']}")
    return engines
