"""TrainingController: starts one TrainingWorker Ray actor per rank in a placement group and fans calls out.

Packs are split over data-parallel ranks round-robin (`dp_shards`) (the packer already padded their number to a multiple of dp);
with `train.sp_size` > 1 the ranks of an sp group get the same shard (`mesh_shards`) and return the same results.
A lost actor or node surfaces as `RecoverableError`, which the Flyte layer turns into a retry that resumes from
the last complete checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

from rlpipe.config import PipelineConfig
from rlpipe.data.packing import Pack, mesh_shards
from rlpipe.errors import RecoverableError
from rlpipe.ray_env import ensure_ray, lost_worker_errors
from rlpipe.rollout.engine import Generation, SamplingParams
from rlpipe.train.metrics import FitMetrics, SFTMetrics, merge_worker_metrics


class TrainingController:
    """The driver-side handle of the training workers."""

    def __init__(self, cfg: PipelineConfig, model_dir: str):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlpipe.train.worker import TrainingWorker

        ensure_ray()
        self.cfg = cfg
        self.world_size = cfg.train.world_size
        self.dp_size = cfg.dp_size
        self.sp_size = cfg.train.sp_size
        use_gpu = cfg.train.device == "cuda" or (cfg.train.device == "auto" and _cluster_has_gpus())
        bundle = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
        self._pg = placement_group([bundle] * self.world_size, strategy="PACK")
        ray.get(self._pg.ready(), timeout=300)
        actor_cls = ray.remote(TrainingWorker)
        cfg_json = cfg.model_dump_json()
        self.workers = [
            actor_cls.options(
                num_cpus=1,
                num_gpus=1 if use_gpu else 0,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank),
            ).remote(cfg_json, model_dir, rank, self.world_size)
            for rank in range(self.world_size)
        ]
        addr, port = self._get(self.workers[0].rendezvous_address.remote())
        self._all("setup", addr, port)

    # ------------------------------------------------------------------ plumbing
    def _get(self, refs: Any) -> Any:
        import ray

        try:
            return ray.get(refs)
        except lost_worker_errors() as exc:
            raise RecoverableError(f"a training worker was lost: {exc}") from exc

    def _all(self, method: str, *args: Any) -> list[Any]:
        """Call `method(*args)` on every rank and wait for all."""
        return self._get([getattr(w, method).remote(*args) for w in self.workers])

    def _per_rank(self, method: str, per_rank_args: list[tuple]) -> list[Any]:
        return self._get([getattr(w, method).remote(*a) for w, a in zip(self.workers, per_rank_args, strict=True)])

    # ------------------------------------------------------------------ phases
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Colocated rollout: each rank samples a contiguous slice of the prompts with its own seed offset."""
        bounds = [round(r * len(prompts) / self.world_size) for r in range(self.world_size + 1)]
        calls = []
        for rank in range(self.world_size):
            p = asdict(params)
            p["seed"] = params.seed * 1000 + rank
            calls.append((prompts[bounds[rank] : bounds[rank + 1]], json.dumps(p)))
        results = self._per_rank("generate", calls)
        out: list[Generation] = []
        for rank, gens in enumerate(results):
            for gen in gens:
                gen.prompt_index += bounds[rank]
                out.append(gen)
        return out

    def compute_logprobs(self, packs: list[Pack], reference: bool = False, temperature: float | None = None) -> list:
        """Old (or reference) logprobs per pack, in the original pack order; `temperature` overrides the RL scoring
        temperature (policy only)."""
        shards = self._shards(packs)
        if reference:
            results = self._per_rank("compute_ref_logprobs", [(s,) for s in shards])
        else:
            results = self._per_rank("compute_logprobs", [(s, temperature) for s in shards])
        return self._unshard(results, len(packs))

    def fit(self, minibatches: list[list[Pack]], iteration: int, total_steps: int, old=None, ref=None) -> FitMetrics:
        """One RL iteration: one optimizer step per mini-batch; each mini-batch is sharded over the dp ranks."""
        packs, steps = [[] for _ in self.workers], [[] for _ in self.workers]
        olds, refs = [[] for _ in self.workers], [[] for _ in self.workers]
        for j, mb in enumerate(minibatches):
            for rank, shard in enumerate(self._shards(mb)):
                packs[rank] += shard
                steps[rank].append(len(shard))
            if old is not None:
                for rank, shard in enumerate(self._shards(old[j])):
                    olds[rank] += shard
            if ref is not None:
                for rank, shard in enumerate(self._shards(ref[j])):
                    refs[rank] += shard
        args = [
            (packs[r], steps[r], iteration, total_steps, olds[r] if old is not None else None,
             refs[r] if ref is not None else None)
            for r in range(self.world_size)
        ]  # fmt: skip
        return merge_worker_metrics(self._per_rank("fit", args))

    def fit_sft(self, packs: list[Pack], total_steps: int) -> SFTMetrics:
        shards = self._shards(packs)
        results: list[SFTMetrics] = self._per_rank("fit_sft", [(s, total_steps) for s in shards])
        merged = results[0]
        merged.step_time_s = max(r.step_time_s for r in results)
        return merged

    def save(self, weights_dir: str) -> list[dict]:
        return self._all("save", weights_dir)

    def load(self, weights_dir: str, worker_states: list[dict] | None) -> None:
        """Load a checkpoint written by any number of workers. With its `worker_states`: weights, optimizer, counters
        and RNG (a resume; `worker_states_for` maps them onto this world size); None: the weights only (a new stage,
        `checkpoint.init_from`)."""
        if worker_states is None:
            self._all("load", weights_dir, None)
            return
        from rlpipe.train.checkpoint_io import worker_states_for

        states = worker_states_for(worker_states, self.world_size, where=os.path.dirname(weights_dir.rstrip("/")))
        self._per_rank("load", [(weights_dir, s) for s in states])

    def save_hf(self, out_dir: str) -> None:
        self._all("save_hf", out_dir)

    def export_serving(self, root: str, version: int) -> str:
        """Write the current policy as a serving directory for a server engine; returns its path."""
        return self._all("export_serving", root, version)[0]

    def init_weight_transfer(self, base_url: str, inference_world_size: int) -> None:
        """GPU path: rank 0 joins the vLLM server's NCCL group."""
        self._all("init_weight_transfer", base_url, inference_world_size)

    def send_weights_nccl(self, version: int, bucket_bytes: int) -> int:
        """GPU path: stream the policy to the server; returns the number of tensors sent."""
        return self._all("send_weights_nccl", version, bucket_bytes)[0]

    def weights_digest(self) -> str:
        return self._all("weights_digest")[0]

    def _shards(self, items: list) -> list[list]:
        """One shard per rank (`rlpipe.data.packing.mesh_shards`: sp ranks of a group share theirs)."""
        return mesh_shards(items, self.dp_size, self.sp_size)

    def _unshard(self, results: list[list], total: int) -> list:
        """Inverse of `mesh_shards`: per-rank results back in the original order (the first sp rank's of a group;
        the others hold the same)."""
        out: list = [None] * total
        for dp_rank in range(self.dp_size):
            for j, value in enumerate(results[dp_rank * self.sp_size]):
                out[dp_rank + j * self.dp_size] = value
        return out

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already gone is fine
                pass
        remove_placement_group(self._pg)
        self.workers = []


def _cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0
