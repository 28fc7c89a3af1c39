"""TrainingWorker: one rank of the trainer, run as a Ray actor (see `controller.py`).

It mirrors the seed worker's `fit()` sequence, split into small steps: old logprobs recomputed by the actor,
entropy, rollout importance sampling and mismatch metrics, reference logprobs and KL, then `optimizer_steps`
mini-batches with a global token-mean loss. Every RL logprob (old, current, reference) is scored at the rollout's
sampling temperature (`rlpipe.algos.logprobs.scoring_temperature(cfg.rollout.temperature)`), SFT at 1. It also hosts an unsharded copy of the policy for HF `generate`
(colocated rollout; refreshed from the sharded weights after every update) and a periodic SFT step.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from rlpipe.algos.logprobs import scoring_temperature
from rlpipe.config import PipelineConfig
from rlpipe.config_checks import check_model_sp_heads
from rlpipe.data.packing import Pack
from rlpipe.models.loading import empty_model, load_model
from rlpipe.models.lora import adapters_disabled, apply_lora, init_adapter_weights, is_adapter_param
from rlpipe.models.packed_attention import scoring_attention
from rlpipe.rollout.engine import Generation, SamplingParams
from rlpipe.rollout.hf_engine import HFRolloutEngine
from rlpipe.train import checkpoint_io as ckpt
from rlpipe.train.distributed import (
    all_reduce_grads,
    all_reduce_sum,
    backend_for,
    data_mesh,
    free_port,
    fsdp_mesh,
    init_process_group,
    pick_device,
    set_data_group,
)
from rlpipe.train.metrics import FitMetrics, SFTMetrics, TrainStepMetrics
from rlpipe.train.objective import BatchStats, StepSums, batch_statistics, rl_microbatch_loss, sft_microbatch_loss
from rlpipe.train.optim import build_optimizer, resolve_optimizer_impl, set_lr, set_optimizer_impl
from rlpipe.train.policy import (
    PolicyModel,
    apply_layer_options,
    autocast_dtype,
    copy_policy_into,
    copy_weights_into,
    full_hf_state_dict,
    load_sharded_weights,
    mixed_precision_policy,
    reshard_root,
    resolve_small_model_auto,
    shard_policy,
    shard_reference,
)
from rlpipe.train.worker_serving import ServingExport


class TrainingWorker(ServingExport):
    """One training rank. Constructed by the controller with its rank and the rendezvous address."""

    def __init__(self, cfg_json: str, model_dir: str, rank: int, world_size: int):
        self.cfg = PipelineConfig.model_validate_json(cfg_json)
        self.model_dir = model_dir
        self.rank, self.world_size = rank, world_size
        self._sharded = False  # FSDP2 units (set by `_build_policy`); False: replicated or a single process
        self.sp_group = None  # the sequence-parallel group (`setup`, train.sp_size > 1); None: whole sequences
        self.device = pick_device(self.cfg.train.device)
        # The distribution the rollout samples from: the PPO ratio, KL and rollout IS must be taken under it.
        self.temperature = scoring_temperature(self.cfg.rollout.temperature)
        if self.device.type == "cpu":
            torch.set_num_threads(self.cfg.train.threads_per_worker)

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 hosts the process-group rendezvous: its node IP and a free port."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the process group, build the sharded policy, optimizer and (if KL is on) the reference model."""
        _seed_everything(self.cfg.train.seed + self.rank, self.cfg.train.deterministic)
        init_process_group(self.rank, self.world_size, master_addr, master_port, backend_for(self.device))
        self.mesh = data_mesh(self.device, self.world_size, self.cfg.train.sp_size)
        self.sp_group = self.mesh["sp"].get_group() if self.cfg.train.sp_size > 1 else None
        if self.sp_group is not None:
            set_data_group(self.mesh["dp"].get_group())  # sp ranks share packs: count their statistics once
        self.policy = self._build_policy(self.model_dir)
        trainable = [p for p in self.policy.parameters() if p.requires_grad]  # LoRA: the adapters only
        self.optimizer = build_optimizer(trainable, self.cfg.train, self.device.type)
        # with LoRA the reference is the policy with its adapters switched off: no second model
        self.ref = self._build_reference() if self.cfg.algo.use_kl_loss and not self._lora else None
        self.rollout_model = None  # unsharded generate copy, built on first use
        self._rollout_stale = True
        self.optimizer_step = 0  # optimizer steps taken (drives the LR schedule)
        self.skipped_steps = 0
        return self.rank

    # ----------------------------------------------------------------- setup
    def _build_policy(self, model_dir: str) -> PolicyModel:
        """The policy, sharded (FSDP2, loaded shard by shard: `_load_sharded`) or replicated (`train.fsdp`), with
        `train.activation_checkpointing` / `compile` on its decoder layers and `train.mixed_precision` applied."""
        train, lora = self.cfg.train, self.cfg.model.lora
        policy = self._empty_policy(model_dir)  # meta parameters: the layout is decided from the size alone
        check_model_sp_heads(policy.hf.config, train.sp_size, model_dir)
        if lora.enabled:
            apply_lora(policy.hf, lora, low_cpu_mem_usage=True)  # before sharding: the adapters are sharded too
        self._sharded = dist.is_initialized() and resolve_small_model_auto(train.fsdp, policy)
        if self._sharded:

            def shard(p: PolicyModel) -> PolicyModel:
                apply_layer_options(p.hf, train.activation_checkpointing, train.compile)  # before fully_shard
                return shard_policy(p, fsdp_mesh(self.mesh), train.fsdp_reshard_after_forward,
                                    mixed_precision_policy(train.mixed_precision))  # fmt: skip

            self._load_sharded(policy, model_dir, shard)
        else:
            policy = self._loaded_policy(model_dir, str(self.device))
            if lora.enabled:
                apply_lora(policy.hf, lora)
            apply_layer_options(policy.hf, train.activation_checkpointing, train.compile)
            policy.autocast_dtype = autocast_dtype(train.mixed_precision)
        if lora.enabled:
            init_adapter_weights(policy, train.seed)  # the same adapters on every rank and in either layout
        policy.hf.config.use_cache = False
        policy.sp_group = self.sp_group
        policy.train()
        return policy

    @property
    def _lora(self) -> bool:
        return self.cfg.model.lora.enabled

    def _build_reference(self) -> PolicyModel:
        """Frozen reference for KL (`ref_load_from` or the base policy), laid out like the policy: FSDP2-sharded
        and loaded shard by shard when the policy is sharded, else a full copy parked on CPU between uses (as the
        seed). `train.ref_offload` keeps a sharded reference's shards in CPU memory on GPU runs."""
        path = self.cfg.train.ref_load_from or self.model_dir
        if not self._sharded:
            ref = self._loaded_policy(path, "cpu")
            ref.eval().requires_grad_(False)
            ref.autocast_dtype = autocast_dtype(self.cfg.train.mixed_precision)  # scored like the policy
            ref.sp_group = self.sp_group
            return ref
        offload = self.cfg.train.ref_offload and self.device.type == "cuda"
        ref = self._empty_policy(path)
        self._load_sharded(ref, path, lambda r: shard_reference(r, fsdp_mesh(self.mesh), offload), offload)
        ref.sp_group = self.sp_group
        return ref

    def _scoring_attention(self) -> str:
        return scoring_attention(self.cfg.model.attn_implementation, self.cfg.train.packed_attention)

    def _empty_policy(self, model_dir: str) -> PolicyModel:
        m = self.cfg.model
        hf = empty_model(model_dir, m.dtype, m.trust_remote_code, self._scoring_attention())
        return PolicyModel(hf, self.cfg.algo.chunk_size)

    def _loaded_policy(self, model_dir: str, device: str) -> PolicyModel:
        m = self.cfg.model
        hf = load_model(model_dir, m.dtype, device, m.trust_remote_code, self._scoring_attention())
        return PolicyModel(hf, self.cfg.algo.chunk_size)

    def _load_sharded(self, model: PolicyModel, model_dir: str, shard, offload: bool = False) -> None:
        """Shard the meta-initialised `model` (`shard(model)`), then each rank reads only its own shards of the
        safetensors: no rank materialises the full model (offloaded shards go to CPU, buffers to the device)."""
        shard(model)
        load_sharded_weights(model, model_dir, "cpu" if offload else self.device, self.device)

    # ----------------------------------------------------------------- rollout (colocated)
    def generate(self, prompts: list[list[int]], params_json: str) -> list[Generation]:
        """Sample from the current policy. A collective when weights are stale: every rank must call it."""
        params = SamplingParams(**json.loads(params_json))
        if self._rollout_stale:
            self._sync_rollout_weights()
        if not prompts:
            return []
        engine = HFRolloutEngine(
            self.rollout_model,
            pad_token_id=self.rollout_model.config.pad_token_id,
            eos_token_id=self.rollout_model.config.eos_token_id,
            batch_size=self.cfg.rollout.batch_size,
        )
        return engine.generate(prompts, params)

    def _sync_rollout_weights(self) -> None:
        if self.rollout_model is None:
            self.rollout_model = load_model(self.model_dir, self.cfg.model.dtype, str(self.device),
                                            self.cfg.model.trust_remote_code, self.cfg.model.attn_implementation)  # fmt: skip
            if self._lora:  # the same module tree as the policy, so the copy below maps name to name
                apply_lora(self.rollout_model, self.cfg.model.lora)
            self.rollout_model.eval().requires_grad_(False)
        copy_policy_into(self.policy, self.rollout_model)
        self._rollout_stale = False

    # ----------------------------------------------------------------- logprobs
    @torch.no_grad()
    def compute_logprobs(self, packs: list[Pack], temperature: float | None = None) -> list[torch.Tensor]:
        """Old-policy logprobs, recomputed by the actor (never taken from the rollout engine), at the RL scoring
        temperature unless `temperature` is given (the weight-sync probe scores at 1, as the server's
        prompt_logprobs do)."""
        t = self.temperature if temperature is None else temperature
        self.policy.eval()
        out = [self.policy.logprobs(p.to(self.device), t).cpu() for p in packs]
        self.policy.train()
        return out

    @torch.no_grad()
    def compute_ref_logprobs(self, packs: list[Pack]) -> list[torch.Tensor]:
        if not self.cfg.algo.use_kl_loss:
            raise RuntimeError("compute_ref_logprobs called but algo.use_kl_loss is off")
        if self._lora:  # the base model: the policy with its adapters off (same forward, same chunked logprob)
            self.policy.eval()
            with adapters_disabled(self.policy):
                out = [self.policy.logprobs(p.to(self.device), self.temperature).cpu() for p in packs]
            self.policy.train()
            return out
        if not self._sharded:
            self.ref.to(self.device)  # a replicated reference is parked on CPU between uses
        out = [self.ref.logprobs(p.to(self.device), self.temperature).cpu() for p in packs]
        if self._sharded:
            reshard_root(self.ref)  # no backward follows: free the gathered embeddings and head now
        else:
            self.ref.to("cpu")
        return out

    # ----------------------------------------------------------------- RL fit
    def fit(
        self,
        packs: list[Pack],
        steps: list[int],
        iteration: int,
        total_steps: int,
        old_logprobs: list[torch.Tensor] | None = None,
        ref_logprobs: list[torch.Tensor] | None = None,
    ) -> FitMetrics:
        """One RL iteration on this rank's packs (the seed's `fit`).

        `steps[i]` is how many of the packs (in order) belong to optimizer step i: the controller splits the batch
        into mini-batches before sharding, so the split does not depend on the world size. `total_steps` sizes the
        LR schedule.
        """
        fit_start = time.perf_counter()
        packs = [p.to(self.device) for p in packs]
        t0 = time.perf_counter()
        on_policy = old_logprobs is None and self._old_is_current(steps)
        if old_logprobs is None and not on_policy:
            old_logprobs = self.compute_logprobs(packs)
        if self.cfg.algo.use_kl_loss and ref_logprobs is None:
            ref_logprobs = self.compute_ref_logprobs(packs)
        logprob_time = time.perf_counter() - t0
        ref_logprobs = [t.to(self.device) for t in ref_logprobs] if ref_logprobs is not None else None
        if on_policy:  # the step's own forward yields the old logprobs; statistics follow from them
            old_logprobs = []
            step = self._rl_step(packs, None, ref_logprobs, None, total_steps, collect_old=old_logprobs)
            metrics = self._fit_metrics(iteration, batch_statistics(packs, old_logprobs, ref_logprobs, self.cfg.algo))
            metrics.steps.append(step)
        else:
            old_logprobs = [t.to(self.device) for t in old_logprobs]
            stats: BatchStats = batch_statistics(packs, old_logprobs, ref_logprobs, self.cfg.algo)
            metrics = self._fit_metrics(iteration, stats)
            start = 0
            for count in steps:
                idx = range(start, start + count)
                start += count
                step = self._rl_step(
                    [packs[i] for i in idx],
                    [old_logprobs[i] for i in idx],
                    [ref_logprobs[i] for i in idx] if ref_logprobs is not None else None,
                    [stats.is_weights[i] for i in idx] if stats.is_weights is not None else None,
                    total_steps,
                )
                metrics.steps.append(step)
        metrics.logprob_time_s = logprob_time
        metrics.skipped_steps = sum(s.skipped for s in metrics.steps)
        metrics.fit_time_s = time.perf_counter() - fit_start
        return metrics

    def _old_is_current(self, steps: list[int]) -> bool:
        """One optimizer step per iteration and no rollout IS: the old policy is the current one, so its logprobs
        are the (detached) logprobs of the training forward itself and a separate forward pass is redundant."""
        single = len(steps) == 1
        return self.cfg.train.old_logprobs == "auto" and single and not self.cfg.algo.rollout_is.enabled

    @staticmethod
    def _fit_metrics(iteration: int, stats: BatchStats) -> FitMetrics:
        return FitMetrics(
            iteration=iteration,
            train_entropy=stats.train_entropy,
            rollout_entropy=stats.rollout_entropy,
            kl=stats.kl,
            tokens=stats.label_tokens,
            total_tokens=stats.real_tokens,
            efficient_attn_ratio=stats.efficient_attn_ratio,
            fit_time_s=0.0,
            logprob_time_s=0.0,
            mismatch=stats.mismatch,
            rollout_is=stats.rollout_is,
        )

    def _rl_step(
        self, packs, old, ref, is_weights, total_steps: int, collect_old: list[torch.Tensor] | None = None
    ) -> TrainStepMetrics:
        """Forward/backward every micro-batch of this step, then one optimizer step.

        `old=None`: on-policy, each pack's old logprobs are its detached training logprobs (appended to
        `collect_old`), so the ratio is exactly 1 and the gradient is the plain policy gradient.
        """
        start = time.perf_counter()
        _reset_peak_memory(self.device)
        global_tokens, global_seqs = _global_counts(packs, self.device)
        lr = set_lr(self.optimizer, self.cfg.train, self.optimizer_step, total_steps)
        sums = StepSums(self.device)
        for i, pack in enumerate(packs):
            logprobs = self.policy.logprobs(pack, self.temperature)
            old_i = old[i] if old is not None else logprobs.detach()
            if collect_old is not None:
                collect_old.append(old_i)
            loss = rl_microbatch_loss(
                logprobs, pack, old_i, ref[i] if ref is not None else None,
                is_weights[i] if is_weights is not None else None, self.cfg.algo, global_tokens, global_seqs,
                self.cfg.rollout.max_new_tokens, sums,
            )  # fmt: skip
            (loss * self._grad_scale()).backward()
        grad_norm, skipped = self._clip_and_step()
        reduced = sums.all_reduce_finalize()
        return TrainStepMetrics(
            step=self.optimizer_step,
            grad_norm=grad_norm,
            lr=lr,
            skipped=skipped,
            tokens=int(global_tokens.item()),
            step_time_s=time.perf_counter() - start,
            peak_memory_mb=_peak_memory_mb(self.device),
            **reduced,
        )

    def _grad_scale(self) -> float:
        """FSDP2 averages gradients over all its ranks (dp x sp); the loss is already a global mean and each sp
        rank's gradient a partial sum, so undo the average."""
        return float(self.world_size) if self._is_sharded() else 1.0

    def _is_sharded(self) -> bool:
        return self._sharded

    def _clip_and_step(self) -> tuple[float, bool]:
        """Clip to `grad_clip`; skip (and count) the update when the norm is not finite."""
        if not self._is_sharded():
            all_reduce_grads(self.policy.parameters())  # replicated policy (train.fsdp off): sum over ranks
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.train.grad_clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm_value = float(norm.item())
        skipped = not math.isfinite(norm_value)
        if skipped:
            self.skipped_steps += 1
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_step += 1
        self._rollout_stale = True
        return norm_value, skipped

    # ----------------------------------------------------------------- SFT
    def fit_sft(self, packs: list[Pack], total_steps: int) -> SFTMetrics:
        """One cross-entropy step on SFT packs with the same optimizer (the seed's `_fit_sft`)."""
        start = time.perf_counter()
        packs = [p.to(self.device) for p in packs]
        global_tokens, _ = _global_counts(packs, self.device)
        lr = set_lr(self.optimizer, self.cfg.train, self.optimizer_step, total_steps)
        loss_sum = torch.zeros((), device=self.device)
        for pack in packs:
            loss = sft_microbatch_loss(self.policy.logprobs(pack), pack, global_tokens) * self.cfg.sft.loss_weight
            (loss * self._grad_scale()).backward()
            loss_sum += loss.detach()
        grad_norm, skipped = self._clip_and_step()
        real = torch.tensor([sum(p.num_sequence_tokens for p in packs)], dtype=torch.float64, device=self.device)
        attn = torch.tensor([sum(p.efficient_attn_ratio * p.length**2 for p in packs),
                             sum(p.length**2 for p in packs)], dtype=torch.float64, device=self.device)  # fmt: skip
        all_reduce_sum(loss_sum)
        all_reduce_sum(real)
        all_reduce_sum(attn)
        return SFTMetrics(
            loss=float(loss_sum.item()),
            grad_norm=grad_norm,
            skipped=skipped,
            tokens=int(global_tokens.item()),
            efficient_attn_ratio=float(attn[0] / attn[1]) if attn[1] > 0 else 0.0,
            step_time_s=time.perf_counter() - start,
            lr=lr,
        )

    # ----------------------------------------------------------------- state
    def save(self, weights_dir: str) -> dict:
        """Collective DCP save of model + optimizer into `weights_dir`; returns this rank's train-loop state."""
        ckpt.save_dcp(self.policy, self.optimizer if self.cfg.checkpoint.save_optimizer else None, Path(weights_dir),
                      self._checkpointed)  # fmt: skip
        return {"optimizer_step": self.optimizer_step, "skipped_steps": self.skipped_steps,
                "rng": ckpt.capture_rng_state()}  # fmt: skip

    def load(self, weights_dir: str, state: dict | None) -> None:
        """Collective DCP load (from any world size). `state` (see `ckpt.worker_states_for`) restores the counters
        and this rank's RNG, or re-seeds it when `rng` is None (the world size changed); `state=None` loads the
        weights only (`checkpoint.init_from`: the optimizer and counters stay fresh)."""
        self._rollout_stale = True
        if state is None:
            ckpt.load_dcp(self.policy, None, Path(weights_dir), self._checkpointed)
            return
        ckpt.load_dcp(self.policy, self.optimizer if self.cfg.checkpoint.save_optimizer else None, Path(weights_dir),
                      self._checkpointed)  # fmt: skip
        set_optimizer_impl(self.optimizer, resolve_optimizer_impl(self.cfg.train.optimizer_impl, self.device.type))
        self.optimizer_step = int(state["optimizer_step"])
        self.skipped_steps = int(state["skipped_steps"])
        if state["rng"] is None:
            seed = ckpt.resume_seed(self.cfg.train.seed, self.rank, self.optimizer_step)
            _seed_everything(seed, self.cfg.train.deterministic)
        else:
            ckpt.restore_rng_state(state["rng"])

    @property
    def _checkpointed(self) -> ckpt.KeyFilter:
        """The weights a checkpoint holds: the adapters of a LoRA policy (the base is the base model's files)."""
        return is_adapter_param if self._lora else None

    def save_hf(self, out_dir: str) -> None:
        """Safetensors export loadable by AutoModelForCausalLM (rank 0 writes; all ranks gather). LoRA: the merged
        model in `out_dir` and the peft adapter in `out_dir/adapter` (`ServingExport._save_lora_export`)."""
        state = full_hf_state_dict(self.policy)
        if self._lora:
            self._save_lora_export(state, out_dir)
        elif self.rank == 0:
            export = load_model(self.model_dir, self.cfg.model.dtype, "cpu", self.cfg.model.trust_remote_code)
            copy_weights_into(export, state)
            export.save_pretrained(out_dir, safe_serialization=True)

    def weights_digest(self) -> str:
        """sha256 of the full weights (a collective): resume/determinism tests compare runs with it."""
        import hashlib

        digest = hashlib.sha256()
        for name, tensor in sorted(full_hf_state_dict(self.policy).items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _global_counts(packs: list[Pack], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Label tokens and sequences over this step's micro-batches on all ranks: the loss denominators."""
    local = [sum(p.num_label_tokens for p in packs), sum(p.num_sequences for p in packs)]
    counts = all_reduce_sum(torch.tensor(local, dtype=torch.float32, device=device))
    return counts[0], counts[1]


def _seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def _reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB
