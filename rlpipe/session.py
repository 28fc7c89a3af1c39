"""RLSession: the resident state of a run (workers, data, samplers, counters) and one method per phase.

The phase functions in `rlpipe.pipeline` open a session from a checkpoint, run one phase and save; `run_segment`
keeps one session for k iterations. Both paths call the same methods, so they produce the same numbers.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from rlpipe.config import PipelineConfig
from rlpipe.data.datasets import PromptDataset, load_prompt_dataset
from rlpipe.data.packing import Pack, pack_sequences, scatter_to_rows
from rlpipe.data.sampler import PromptSampler
from rlpipe.data.sft import SFTDataset, load_sft_dataset, sft_sequence_items
from rlpipe.data.tasks import write_task_dataset
from rlpipe.errors import CheckpointError, ConfigError
from rlpipe.models.loading import load_tokenizer
from rlpipe.models.packed_attention import PACKED_SDPA, scoring_attention
from rlpipe.rollout.batch import batch_to_items, build_rollout_batch, score_generations
from rlpipe.rollout.engine import SamplingParams
from rlpipe.rollout.judges import get_judge
from rlpipe.train import checkpoint as ckpt
from rlpipe.train.controller import TrainingController
from rlpipe.train.lineage import (
    BaseModelRef,
    DataRef,
    ServedRef,
    build_manifest,
    model_architecture,
    model_fingerprint,
)


@dataclass
class LoopState:
    """Counters that a resume must restore exactly (JSON in train_state.json)."""

    iteration: int = 0  # RL iterations completed
    optimizer_step: int = 0  # optimizer steps taken (RL + SFT)
    consumed_prompts: int = 0
    consumed_tokens: int = 0
    sft_steps: int = 0
    data: list[dict] = field(default_factory=list)  # data consumed since the last checkpoint (lineage)
    served: list[dict] = field(default_factory=list)  # weights a server engine served since then (lineage)


class RLSession:
    """Everything a phase needs, opened from the base model or a checkpoint."""

    def __init__(self, cfg: PipelineConfig, model_dir: str, checkpoint: str | None = None, log=print):
        get_judge(cfg.rollout.judge)  # an unknown judge fails here, not after Ray and a rollout
        self.cfg, self.model_dir, self.log = cfg, model_dir, log
        self.tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
        self.prompts = self._load_prompts()
        self.sampler = PromptSampler(len(self.prompts), cfg.rollout.prompts_per_step, seed=cfg.data.seed)
        self.sft_data: SFTDataset | None = self._load_sft() if cfg.sft.enabled else None
        self.sft_sampler = (
            PromptSampler(len(self.sft_data), cfg.sft.global_batch_size, seed=cfg.train.seed + 1)
            if self.sft_data is not None
            else None
        )
        self.state = LoopState()
        self.parent: str | None = None
        self.parent_weights_only = False  # the next checkpoint's parent gave only its weights (checkpoint.init_from)
        _check_vocab(self.tokenizer, model_dir)
        init_from = cfg.checkpoint.init_from if checkpoint is None else None  # a resume of this run wins
        for source in (checkpoint, init_from):  # fail before any worker starts
            if source is not None:
                self._verify(source)
        self.controller = TrainingController(cfg, model_dir)
        self.engine_sync = None  # rollout.engine = vllm | sglang: the synced server engine
        self.save_hooks: list = []  # save_hook(tmp_dir) -> dict merged into train_state.json's `extra`
        try:
            if checkpoint is not None:
                self._resume(checkpoint)
            elif init_from is not None:
                self._init_weights_from(init_from)
            if cfg.rollout.engine in ("vllm", "sglang"):
                from rlpipe.serving import build_engine_sync

                self.engine_sync = build_engine_sync(cfg, model_dir, self.controller, self.tokenizer, self.prompts, log)
        except BaseException:
            self.controller.shutdown()  # a failed resume or server start must not hold the workers' CPUs
            raise

    # ------------------------------------------------------------------ data
    def _data_file(self, name: str, kind: str, n: int, seed: int, split: str = "train") -> Path:
        """Built-in task rows are written to parquet once, then read back through the user-data path. ``split``
        "eval" draws held-out problems (disjoint from every train problem for tasks that support it)."""
        suffix = "" if split == "train" else f"-{split}"
        path = Path(self.cfg.output_dir) / "data" / f"{name}-{kind}-n{n}-seed{seed}{suffix}.parquet"
        if not path.exists():
            write_task_dataset(name, n, seed, path, kind=kind, split=split)
        return path

    def _load_prompts(self) -> PromptDataset:
        d = self.cfg.data
        path = Path(d.path) if d.path else self._data_file(d.task, "rl", d.num_prompts, d.seed)
        return load_prompt_dataset(
            path,
            self.tokenizer,
            d.max_prompt_length,
            prompt_key=d.prompt_key,
            apply_chat_template=d.apply_chat_template,
        )

    def _load_eval_prompts(self) -> PromptDataset:
        d = self.cfg.data
        path = (
            Path(d.eval_path)
            if d.eval_path
            else self._data_file(d.task, "rl", d.num_eval_prompts, d.seed + 104729, split="eval")
        )
        return load_prompt_dataset(
            path,
            self.tokenizer,
            d.max_prompt_length,
            prompt_key=d.prompt_key,
            apply_chat_template=d.apply_chat_template,
        )

    def _load_sft(self) -> SFTDataset:
        s = self.cfg.sft
        path = (
            Path(s.path)
            if s.path
            else self._data_file(self.cfg.data.task, "sft", s.num_examples, self.cfg.data.seed + 7)
        )
        return load_sft_dataset(path, self.tokenizer, s.max_length)

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run: sizes the LR schedule."""
        sft = self.cfg.iterations // self.cfg.sft.rollout_steps_per_sft if self.cfg.sft.enabled else 0
        return self.cfg.iterations * self.cfg.train.optimizer_steps + sft

    def sft_due(self, iteration: int) -> bool:
        """SFT after every `rollout_steps_per_sft`-th RL iteration (1-based), as the seed does."""
        return self.cfg.sft.enabled and iteration % self.cfg.sft.rollout_steps_per_sft == 0

    def _minibatches(self, items) -> list[list[Pack]]:
        """Split the batch into `optimizer_steps` contiguous mini-batches, each packed and padded to a multiple of
        dp: the split is a property of the data, so world size 1 and N take the same optimizer steps."""
        k = min(self.cfg.train.optimizer_steps, len(items))
        bounds = [round(i * len(items) / k) for i in range(k + 1)]
        return [self._pack(items[bounds[i] : bounds[i + 1]]) for i in range(k)]

    def _pack(self, items) -> list[Pack]:
        return pack_sequences(
            items,
            self.cfg.train.pack_max_length,
            self.tokenizer.pad_token_id,
            self.cfg.dp_size,
            pad_to_max_length=False,
            share_prompts=self.share_prompts,
            balance=True,
        )

    @property
    def share_prompts(self) -> bool:
        """Shared-prompt packs need the per-sequence packed attention (the only backend that reads `prefix_of`)."""
        t = self.cfg.train
        return (
            t.share_prompts and scoring_attention(self.cfg.model.attn_implementation, t.packed_attention) == PACKED_SDPA
        )

    # ------------------------------------------------------------------ phases
    def sampling_params(self, iteration: int, eval_mode: bool = False) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            n=1 if eval_mode else r.n,
            temperature=r.eval_temperature if eval_mode else r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=[self.tokenizer.eos_token_id],
            seed=self.cfg.train.seed * 100_003 + iteration,
        )

    def rollout(self) -> tuple[pd.DataFrame, dict[str, float]]:
        """Sample `n` responses for the next prompts, judge them, compute advantages."""
        iteration = self.state.iteration + 1
        indices = self.sampler.next_batch()
        batch, stats = self.sample_batch(indices, iteration, self._generate)
        self.account_rollout(iteration, len(indices), stats)
        return batch, stats

    def sample_batch(self, indices: list[int], iteration: int, generate) -> tuple[pd.DataFrame, dict[str, float]]:
        """The rollout batch of `iteration` for prompts `indices`; changes no session state (a producer thread of
        `rlpipe.pipelined` calls it, with its own `generate(prompts, params) -> (generations, engine stats)`)."""
        start = time.perf_counter()
        examples = [self.prompts[i] for i in indices]
        params = self.sampling_params(iteration)
        gens, engine_stats = generate([ex.prompt_ids for ex in examples], params)
        texts, rewards = score_generations(examples, gens, self._decode, get_judge(self.cfg.rollout.judge))
        batch, stats = build_rollout_batch(
            examples, gens, texts, rewards, params.n, self.cfg.algo.advantage,
            _advantage_kwargs(self.cfg), self.cfg.rollout.filter_uniform_groups,
        )  # fmt: skip
        elapsed = time.perf_counter() - start
        gen_tokens = sum(len(g.response_ids) for g in gens)
        stats.update({"rollout_time_s": elapsed, "rollout_tokens_per_s": gen_tokens / elapsed if elapsed else 0.0})
        stats.update(engine_stats)
        return batch, stats

    def account_rollout(self, iteration: int, num_prompts: int, stats: dict[str, float]) -> None:
        """Count a batch's prompts and record its lineage when it is trained (not when a producer samples it)."""
        self.state.consumed_prompts += num_prompts
        if self.cfg.rollout.engine != "hf":
            record_served(self.state.served, iteration, self._engine_name(), int(stats["engine/weight_version"]))
        record_data(self.state.data, "prompts", iteration, str(self.prompts.path), self.prompts.content_hash)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list, dict[str, float]]:
        """Generations and `engine/*` metrics: the version a server served and what syncing it cost."""
        version = self.state.optimizer_step  # the policy's weight version: every RL or SFT step changes it
        if self.engine_sync is not None:
            gens = self.engine_sync.generate(prompts, params, version)
            return gens, self.engine_sync.stats.row(self.engine_sync.engine.served_version)
        if self.cfg.rollout.engine == "openai":
            from rlpipe.rollout.openai_engine import OpenAIRolloutEngine

            r = self.cfg.rollout
            engine = OpenAIRolloutEngine(
                r.server_url, r.server_model or "default", eos_token_id=self.tokenizer.eos_token_id
            )
            # Never synced: it serves the weights it was started with, `version` optimizer steps behind.
            return engine.generate(prompts, params), {
                "engine/weight_version": -1.0,
                "engine/weight_lag": float(version),
            }
        return self.controller.generate(prompts, params), {}

    def _engine_name(self) -> str:
        if self.engine_sync is not None:
            return self.engine_sync.engine.name
        return f"{self.cfg.rollout.engine} {self.cfg.rollout.server_url}"

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def compute_logprobs(self, batch: pd.DataFrame) -> pd.DataFrame:
        """Add old-policy (and, with KL on, reference) logprobs, response-aligned, as columns."""
        batch = batch.copy()
        packs = self._pack(batch_to_items(batch))
        old = self.controller.compute_logprobs(packs)
        batch["old_logprobs"] = scatter_to_rows(packs, old, len(batch))
        if self.cfg.algo.use_kl_loss:
            ref = self.controller.compute_logprobs(packs, reference=True)
            batch["ref_logprobs"] = scatter_to_rows(packs, ref, len(batch))
        return batch

    def train(self, batch: pd.DataFrame) -> dict[str, float]:
        """One RL update on the batch (old/ref logprobs are recomputed unless the batch carries them)."""
        iteration = self.state.iteration + 1
        if len(batch) == 0:
            self.log(f"iteration {iteration}: every group was filtered out; no update")
            self.state.iteration = iteration
            return {"skipped_iteration": 1.0}
        items = batch_to_items(batch)
        minibatches = self._minibatches(items)
        old = _aligned(self, batch, "old_logprobs", items)
        ref = _aligned(self, batch, "ref_logprobs", items) if self.cfg.algo.use_kl_loss else None
        metrics = self.controller.fit(minibatches, iteration, self.total_steps, old, ref)
        self.state.iteration = iteration
        self.state.optimizer_step += len(metrics.steps)
        self.state.consumed_tokens += metrics.total_tokens
        return metrics.summary()

    def sft(self) -> dict[str, float]:
        """One SFT step on the next SFT batch (same optimizer)."""
        items = sft_sequence_items([self.sft_data[i] for i in self.sft_sampler.next_batch()])
        metrics = self.controller.fit_sft(self._pack(items), self.total_steps)
        self.state.optimizer_step += 1
        self.state.sft_steps += 1
        record_data(self.state.data, "sft", self.state.iteration, str(self.sft_data.path), self.sft_data.content_hash)
        return metrics.summary()

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on held-out prompts (the number a user watches besides training reward)."""
        data = self._load_eval_prompts()
        examples = [data[i] for i in range(len(data))]
        gens, _ = self._generate([ex.prompt_ids for ex in examples], self.sampling_params(0, eval_mode=True))
        _, rewards = score_generations(examples, gens, self._decode, get_judge(self.cfg.rollout.judge))
        return {"eval/reward_mean": float(np.mean(rewards)), "eval/num_prompts": float(len(examples))}

    # ------------------------------------------------------------------ checkpoint
    def save(self, phase: str, metrics: dict[str, float] | None = None) -> str:
        """Write a complete checkpoint atomically and return its path; it becomes the parent of the next one."""
        root = self.cfg.checkpoint.root
        tmp = ckpt.begin_checkpoint(root, self.cfg.experiment, self.state.optimizer_step)
        try:
            worker_states = self.controller.save(str(tmp / "weights"))
            state = self._train_state(worker_states)
            for hook in self.save_hooks:  # e.g. rlpipe.pipelined: the batches sampled ahead of the trainer
                state.extra.update(hook(tmp))
            ckpt.write_train_state(tmp, state)
            ckpt.write_config(tmp, self.cfg.model_dump(mode="json"))
            if self.cfg.checkpoint.save_hf:  # a servable model dir: weights and the tokenizer (vLLM/SGLang need both)
                self.controller.save_hf(str(tmp / ckpt.HF_DIR))
                self.tokenizer.save_pretrained(str(tmp / ckpt.HF_DIR))
            manifest = build_manifest(
                experiment=self.cfg.experiment,
                step=self.state.optimizer_step,
                iteration=self.state.iteration,
                base_model=BaseModelRef(
                    path=_absolute(self.model_dir),
                    fingerprint=model_fingerprint(self.model_dir),
                    architecture=model_architecture(self.model_dir),
                ),
                parent=self.parent,
                parent_weights_only=self.parent_weights_only,
                data=[DataRef(**d) for d in self.state.data],
                served=[ServedRef(**d) for d in self.state.served],
                config=self.cfg.model_dump(mode="json"),
                metrics={k: v for k, v in (metrics or {}).items() if isinstance(v, int | float)},
                phase=phase,
            )
            final = ckpt.finalize_checkpoint(tmp, manifest)
        except BaseException:
            ckpt.abort_checkpoint(tmp)
            raise
        self.parent = _absolute(final)  # a relative root must still resolve when read from elsewhere
        self.parent_weights_only = False
        self.state.data = []
        self.state.served = []
        return str(final)

    def _train_state(self, worker_states: list[dict]) -> ckpt.TrainState:
        return ckpt.TrainState(
            step=self.state.optimizer_step,
            iteration=self.state.iteration,
            epoch=self.sampler.state_dict()["epoch"],
            consumed_samples=self.state.consumed_prompts,
            consumed_tokens=self.state.consumed_tokens,
            sampler_state=self.sampler.state_dict(),
            sft_loader_state=self.sft_sampler.state_dict() if self.sft_sampler else None,
            rng_states=[ckpt.capture_rng_state()],  # the driver's; each worker's own is in worker_states
            worker_states=worker_states,
            extra={"sft_steps": self.state.sft_steps},
        )

    def _verify(self, checkpoint: str) -> None:
        """Checksums, and the same model shape: a mismatch names the config fields that differ."""
        ckpt.verify_checkpoint(
            checkpoint,
            expect_model_fingerprint=model_fingerprint(self.model_dir),
            expect_model_name=self.model_dir,
            expect_architecture=model_architecture(self.model_dir),
        )

    def _resume(self, checkpoint: str) -> None:
        """Continue the checkpoint's run, on this run's world size (which may differ from the checkpoint's)."""
        path = Path(checkpoint)
        state = ckpt.load_train_state(path)
        if len(state.worker_states) != self.controller.world_size:
            self.log(f"resuming {path} (written by {len(state.worker_states)} workers) on "
                     f"{self.controller.world_size}: weights, optimizer, counters and samplers continue; the workers' "
                     "RNG is re-seeded (bitwise continuation needs the same world size)")  # fmt: skip
        self.controller.load(str(path / ckpt.WEIGHTS_DIR), state.worker_states)
        self.state = LoopState(
            iteration=state.iteration,
            optimizer_step=state.step,
            consumed_prompts=state.consumed_samples,
            consumed_tokens=state.consumed_tokens,
            sft_steps=int(state.extra.get("sft_steps", 0)),
        )
        self.sampler.load_state_dict(state.sampler_state)
        if self.sft_sampler is not None:
            if state.sft_loader_state is None:
                raise CheckpointError(f"{path}: sft is enabled but the checkpoint has no SFT sampler state")
            self.sft_sampler.load_state_dict(state.sft_loader_state)
        ckpt.restore_rng_state(state.rng_states[0])
        self.parent = _absolute(path)

    def _init_weights_from(self, checkpoint: str) -> None:
        """A new stage (`checkpoint.init_from`): the checkpoint's weights, with a fresh optimizer, LR schedule,
        counters, samplers and RNG; its first checkpoint names this one as a weights-only parent."""
        self.controller.load(str(Path(checkpoint) / ckpt.WEIGHTS_DIR), None)
        self.parent, self.parent_weights_only = _absolute(checkpoint), True

    def close(self) -> None:
        try:
            if self.engine_sync is not None:
                self.engine_sync.close()
        finally:
            self.controller.shutdown()


def record_data(data: list[dict], role: str, iteration: int, path: str, sha256: str | None) -> None:
    """Note that `iteration` read `path` in `role`. A run of iterations reading the same file is one lineage entry
    (`prompts@301-400`), not one per iteration: a segment of 100 iterations would otherwise list the file 100 times."""
    for entry in reversed(data):
        name, _, span = entry["name"].partition("@")
        if name == role:
            if entry["path"] == path and entry["sha256"] == sha256:
                entry["name"] = f"{role}@{span.split('-')[0]}-{iteration}"
                return
            break
    data.append({"name": f"{role}@{iteration}", "path": path, "sha256": sha256})


def record_served(served: list[dict], iteration: int, engine: str, version: int) -> None:
    """Note that `iteration`'s rollouts came from `engine` serving weight `version`; consecutive iterations from the
    same engine share one lineage entry."""
    if served and served[-1]["engine"] == engine:
        start = served[-1]["iterations"].split("-")[0]
        served[-1]["iterations"] = f"{start}-{iteration}"
        served[-1]["weight_versions"].append(version)
        return
    served.append({"iterations": str(iteration), "engine": engine, "weight_versions": [version]})


def _aligned(session: RLSession, batch: pd.DataFrame, column: str, items) -> list[list[torch.Tensor]] | None:
    """Response-aligned per-row values (a batch column) as label-aligned tensors per mini-batch and pack, in the
    same packing order as `_minibatches` (packing depends only on lengths, so the layouts coincide)."""
    if column not in batch.columns:
        return None
    import dataclasses

    shadow = [dataclasses.replace(it, rollout_logprobs=[float(x) for x in batch[column].iloc[it.row]]) for it in items]
    return [[p.rollout_logprobs for p in mb] for mb in session._minibatches(shadow)]


def _absolute(location: str | Path) -> str:
    """Manifest locations (`parent`, `base_model.path`) are stored absolute (URIs as they are): a manifest is read
    from any working directory."""
    text = str(location)
    return text if "://" in text else str(Path(text).resolve())


def _check_vocab(tokenizer, model_dir: str) -> None:
    """A tokenizer with ids beyond the model's embedding would index out of range deep inside a worker."""
    vocab = json.loads((Path(model_dir) / "config.json").read_text()).get("vocab_size")
    if vocab is not None and len(tokenizer) > vocab:
        raise ConfigError(
            f"tokenizer in {model_dir} has {len(tokenizer)} tokens but the model embeds only {vocab}: "
            "mismatched tokenizer and model"
        )


def _advantage_kwargs(cfg: PipelineConfig) -> dict:
    if cfg.algo.advantage == "pass_at_k":
        return {"k": cfg.algo.pass_at_k}
    if cfg.algo.advantage == "dr_grpo":
        return {"max_length": cfg.rollout.max_new_tokens}
    return {}


def seed_driver(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
