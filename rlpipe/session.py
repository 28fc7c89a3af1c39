"""RLSession: the resident state of a run (workers, data, samplers, rollout source, run state) and one method per
phase.

`rlpipe.phases` opens a session from a checkpoint, runs one phase and saves; `rlpipe.loop.run_segment` keeps one
session for k iterations. Both call the same methods, so they produce the same numbers. What the session delegates:
data files to `rlpipe.data.loaders`, packing to `rlpipe.data.batching`, sampling to a `rlpipe.rollout.sources`
source, counters, lineage and checkpoints to `rlpipe.train.run_state`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd

from rlpipe.config import SEED_LIMIT, PipelineConfig
from rlpipe.config_checks import check_roots_writable
from rlpipe.data.batching import Batching
from rlpipe.data.datasets import PromptDataset
from rlpipe.data.loaders import load_prompts, load_sft
from rlpipe.data.packing import scatter_to_rows
from rlpipe.data.sampler import EpochSampler
from rlpipe.data.sft import sft_sequence_items
from rlpipe.errors import ConfigError
from rlpipe.models.loading import load_tokenizer
from rlpipe.rollout.batch import batch_to_items, build_rollout_batch, score_generations
from rlpipe.rollout.engine import SamplingParams
from rlpipe.rollout.judges import get_judge
from rlpipe.rollout.sources import RolloutSource, build_rollout_source
from rlpipe.schedule import Schedule
from rlpipe.train.checkpoint import Counters
from rlpipe.train.controller import TrainingController
from rlpipe.train.run_state import RunState, Samplers


class RLSession:
    """Everything a phase needs, opened from the base model or a checkpoint."""

    def __init__(self, cfg: PipelineConfig, model_dir: str, checkpoint: str | None = None, log=print):
        self.judge = get_judge(cfg.rollout.judge)  # an unknown judge fails here, not after Ray and a rollout
        check_roots_writable(cfg)  # not at the first save, a segment later
        self.cfg, self.model_dir, self.log = cfg, model_dir, log
        self.schedule = Schedule(cfg)
        self.tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
        _check_vocab(self.tokenizer, model_dir)
        self.prompts = load_prompts(cfg, self.tokenizer, "train")
        self._eval_prompts: PromptDataset | None = None
        self.sampler = _sampler(self.prompts, cfg.rollout.prompts_per_step, cfg.data.seed, "rollout.prompts_per_step")
        self.sft_data = load_sft(cfg, self.tokenizer) if cfg.sft.enabled else None
        self.sft_sampler = (
            _sampler(self.sft_data, cfg.sft.global_batch_size, cfg.train.seed + 1, "sft.global_batch_size")
            if self.sft_data is not None
            else None
        )
        self.batching = Batching(cfg, self.tokenizer.pad_token_id)
        self.run = RunState(cfg, model_dir, log)
        init_from = cfg.checkpoint.init_from if checkpoint is None else None  # a resume of this run wins
        for source in (checkpoint, init_from):  # fail before any worker starts
            if source is not None:
                self.run.verify(source)
        self.controller = TrainingController(cfg, model_dir)
        self.rollout_source: RolloutSource | None = None
        try:
            if checkpoint is not None:
                self.run.resume(checkpoint, self.controller, self.samplers)
            elif init_from is not None:
                self.run.init_weights_from(init_from, self.controller)
            self.rollout_source = build_rollout_source(
                cfg, model_dir, self.controller, self.tokenizer, self.prompts, log
            )
        except BaseException:
            self.controller.shutdown()  # a failed resume or server start must not hold the workers' CPUs
            raise

    @property
    def counters(self) -> Counters:
        return self.run.counters

    @property
    def samplers(self) -> Samplers:
        return Samplers(self.sampler, self.sft_sampler)

    # ------------------------------------------------------------------ rollout
    def sampling_params(self, iteration: int, eval_mode: bool = False) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            n=1 if eval_mode else r.n,
            temperature=r.eval_temperature if eval_mode else r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=[self.tokenizer.eos_token_id],
            seed=(self.cfg.train.seed * 100_003 + iteration) % SEED_LIMIT,  # torch.manual_seed takes < 2**64
        )

    def rollout(self) -> tuple[pd.DataFrame, dict[str, float]]:
        """Sample `n` responses for the next prompts, judge them, compute advantages."""
        iteration = self.counters.iteration + 1
        indices = self.sampler.next_batch()
        batch, stats = self.sample_batch(indices, iteration, self.generate)
        self.account_rollout(iteration, len(indices), stats)
        return batch, stats

    def sample_batch(self, indices: list[int], iteration: int, generate) -> tuple[pd.DataFrame, dict[str, float]]:
        """The rollout batch of `iteration` for prompts `indices`; changes no session state (the producer thread of
        `rlpipe.loop_async` calls it, with its own `generate(prompts, params) -> (generations, engine stats)`)."""
        start = time.perf_counter()
        examples = [self.prompts[i] for i in indices]
        params = self.sampling_params(iteration)
        gens, engine_stats = generate([ex.prompt_ids for ex in examples], params)
        texts, rewards = score_generations(examples, gens, self.decode, self.judge)
        batch, stats = build_rollout_batch(
            examples, gens, texts, rewards, params.n, self.cfg.algo.advantage,
            _advantage_kwargs(self.cfg), self.cfg.rollout.filter_uniform_groups,
        )  # fmt: skip
        elapsed = time.perf_counter() - start
        gen_tokens = sum(len(g.response_ids) for g in gens)
        stats.update({"rollout_time_s": elapsed, "rollout_tokens_per_s": gen_tokens / elapsed if elapsed else 0.0})
        stats.update(engine_stats)
        return batch, stats

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list, dict[str, float]]:
        """Generations from the run's rollout source, serving the policy's current version (its optimizer step)."""
        return self.rollout_source.generate(prompts, params, self.counters.step)

    def account_rollout(self, iteration: int, num_prompts: int, stats: dict[str, float]) -> None:
        """Count a batch's prompts and record its lineage when it is trained (not when a producer samples it)."""
        self.counters.consumed_prompts += num_prompts
        if self.rollout_source.lineage_name is not None:
            self.run.record_served(iteration, self.rollout_source.lineage_name, int(stats["engine/weight_version"]))
        self.run.record_data("prompts", iteration, str(self.prompts.path), self.prompts.content_hash)

    def account_external_rollout(self, iteration: int) -> None:
        """The granular train phase: another session (the rollout task) sampled this iteration's prompts; advance the
        sampler past them and count them, so the checkpoint continues the stream where the rollout left it."""
        self.sampler.next_batch()
        self.counters.consumed_prompts += self.cfg.rollout.prompts_per_step
        self.run.data.append({"name": f"rollout@{iteration}", "path": "<rollout batch>", "sha256": None})

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ training
    def compute_logprobs(self, batch: pd.DataFrame) -> pd.DataFrame:
        """Add old-policy (and, with KL on, reference) logprobs, response-aligned, as columns."""
        batch = batch.copy()
        packs = self.batching.pack(batch_to_items(batch))
        batch["old_logprobs"] = scatter_to_rows(packs, self.controller.compute_logprobs(packs), len(batch))
        if self.cfg.algo.use_kl_loss:
            ref = self.controller.compute_logprobs(packs, reference=True)
            batch["ref_logprobs"] = scatter_to_rows(packs, ref, len(batch))
        return batch

    def train(self, batch: pd.DataFrame) -> dict[str, float]:
        """One RL update on the batch (old/ref logprobs are recomputed unless the batch carries them)."""
        iteration = self.counters.iteration + 1
        if len(batch) == 0:
            self.log(f"iteration {iteration}: every group was filtered out; no update")
            self.counters.iteration = iteration
            return {"skipped_iteration": 1.0}
        items = batch_to_items(batch)
        old = self.batching.aligned(batch, "old_logprobs", items)
        ref = self.batching.aligned(batch, "ref_logprobs", items) if self.cfg.algo.use_kl_loss else None
        metrics = self.controller.fit(self.batching.minibatches(items), iteration, self.schedule.total_steps, old, ref)
        self.counters.iteration = iteration
        self.counters.step += len(metrics.steps)
        self.counters.consumed_tokens += metrics.total_tokens
        return metrics.summary()

    def sft(self) -> dict[str, float]:
        """One SFT step on the next SFT batch (same optimizer)."""
        items = sft_sequence_items([self.sft_data[i] for i in self.sft_sampler.next_batch()])
        metrics = self.controller.fit_sft(self.batching.pack(items), self.schedule.total_steps)
        self.counters.step += 1
        self.counters.sft_steps += 1
        self.run.record_data("sft", self.counters.iteration, str(self.sft_data.path), self.sft_data.content_hash)
        return metrics.summary()

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on held-out prompts (the number a user watches besides training reward)."""
        rewards = self.eval_rewards()
        return {"eval/reward_mean": float(np.mean(rewards)), "eval/num_prompts": float(len(rewards))}

    def eval_rewards(self) -> np.ndarray:
        """The reward of each held-out prompt's greedy answer, in the eval split's order (so two evaluations of
        the same run pair up prompt by prompt, as a paired significance test needs)."""
        if self._eval_prompts is None:
            self._eval_prompts = load_prompts(self.cfg, self.tokenizer, "eval")
        examples = [self._eval_prompts[i] for i in range(len(self._eval_prompts))]
        gens, _ = self.generate([ex.prompt_ids for ex in examples], self.sampling_params(0, eval_mode=True))
        _, rewards = score_generations(examples, gens, self.decode, self.judge)
        return np.asarray(rewards, dtype=np.float64)

    # ------------------------------------------------------------------ checkpoints
    def save(self, phase: str, metrics: dict[str, float] | None = None) -> str:
        """A complete checkpoint of the run as it stands (`RunState.save`)."""
        return self.run.save(phase, metrics, self.controller, self.tokenizer, self.samplers)

    def close(self) -> None:
        try:
            if self.rollout_source is not None:
                self.rollout_source.close()
        finally:
            self.controller.shutdown()


def _sampler(data, batch_size: int, seed: int, key: str) -> EpochSampler:
    """The sampler over a dataset; a batch the data cannot fill names the config key and the file."""
    try:
        return EpochSampler(len(data), batch_size, seed=seed)
    except ConfigError as exc:
        raise ConfigError(f"{key}={batch_size} with {data.path} ({len(data)} rows): {exc}") from None


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
