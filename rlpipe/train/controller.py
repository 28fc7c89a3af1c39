"""TrainingController: starts one TrainingWorker Ray actor per rank in a placement group and fans calls out.

The group's strategy is `train.placement` (pack: Ray PACK, spread: STRICT_SPREAD) and each bundle adds the custom
`train.resources`; a group the cluster cannot place within `train.placement_timeout_s` is an error naming them.

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
from rlpipe.errors import ConfigError, RecoverableError
from rlpipe.ray_env import ensure_ray, lost_worker_errors
from rlpipe.rollout.engine import Generation, SamplingParams
from rlpipe.train.metrics import FitMetrics, SFTMetrics, merge_worker_metrics


class TrainingController:
    """The driver-side handle of the training workers."""

    def __init__(self, cfg: PipelineConfig, model_dir: str):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlpipe.train.worker import TrainingWorker

        ensure_ray()
        self.cfg = cfg
        self.world_size = cfg.train.world_size
        self.dp_size = cfg.dp_size
        self.sp_size = cfg.train.sp_size
        use_gpu = cfg.train.device == "cuda" or (cfg.train.device == "auto" and _cluster_has_gpus())
        bundle = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
        self._pg = place_trainers(cfg, {**bundle, **cfg.train.resources})
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
        """Every rank writes its DCP shard; the driver then checks it sees them all (`check_dcp_visible`)."""
        from rlpipe.train.checkpoint_io import check_dcp_visible

        states = self._all("save", weights_dir)
        check_dcp_visible(weights_dir)
        return states

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

    def export_serving_ref(self):
        """The policy's safetensors file (a uint8 array, `serving_buffer`) as an ObjectRef held in rank 0's object
        store, never fetched here: engine replicas on other nodes pull it from there (no shared filesystem needed)."""
        import ray

        refs = [w.export_serving_buffer.remote() for w in self.workers]
        self._get(refs[1:])  # the other ranks only joined the gather (a rank-0 error surfaces where it is pulled)
        ray.wait(refs[:1], fetch_local=False)
        return refs[0]

    def init_weight_transfer(self, endpoints: list) -> None:
        """GPU path: rank 0 joins one NCCL group with every vLLM server (`nccl_transfer.ControlEndpoint`s)."""
        self._all("init_weight_transfer", endpoints)

    def send_weights_nccl(self, version: int, bucket_bytes: int) -> int:
        """GPU path: stream the policy to every server; returns the number of tensors sent."""
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


PLACEMENT_STRATEGY = {"pack": "PACK", "spread": "STRICT_SPREAD"}
"""Ray strategy of each `train.placement`. spread is STRICT_SPREAD, not SPREAD: SPREAD silently packs ranks onto
one node when the cluster has too few, so a run asked to spread could train packed without anyone knowing."""


def place_trainers(cfg: PipelineConfig, bundle: dict[str, float]):
    """A ready placement group of `train.world_size` copies of `bundle`, or a ConfigError after the timeout.

    Why the timeout: Ray keeps an unplaceable group pending forever (it only logs a warning), so a run asking for
    more nodes or resources than the cluster has would hang instead of saying what it asked for.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    train = cfg.train
    pg = placement_group([bundle] * train.world_size, strategy=PLACEMENT_STRATEGY[train.placement])
    if pg.wait(timeout_seconds=train.placement_timeout_s):
        return pg
    remove_placement_group(pg)  # a pending group would grab the resources later, after this run failed
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    raise ConfigError(
        f"the Ray cluster cannot place the trainer ranks within train.placement_timeout_s="
        f"{train.placement_timeout_s:g}: train.placement={train.placement} ({PLACEMENT_STRATEGY[train.placement]}) "
        f"of train.world_size={train.world_size} bundles of {bundle} (train.resources={train.resources}); "
        f"the {len(nodes)} alive node(s) offer {[_summary(r) for r in nodes]}. Add nodes or resources, lower "
        "train.world_size, use train.placement=pack, or change train.resources"
    )


def _summary(resources: dict[str, float]) -> dict[str, float]:
    """A node's resources without Ray's per-node bookkeeping entries (node:<ip>, memory in bytes)."""
    skip = ("node:", "memory", "object_store_memory", "accelerator_type:")
    return {k: v for k, v in resources.items() if not k.startswith(skip)}


def _cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0
