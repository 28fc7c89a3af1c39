"""Batched HF ``generate`` rollout engine (the default; runs wherever the policy weights live).

Prompts are left-padded with an attention mask (positions then start at 0 for every row, as in training) and
sampled with a KV cache. The ``n`` samples of a prompt share its prefill: all but the last prompt token are run once
per prompt, the cache is repeated ``n`` times, and ``generate`` continues from it (for short responses the prefill
of ``n`` identical prompts was most of a rollout; the samples are the same, the logits equal to float rounding).
Logprobs come from the raw logits generate returns (``output_logits=True``), divided by the sampling temperature
(``scoring_temperature``: 1 for greedy, no division at 1): the tempered, unfiltered (before top-p/top-k)
distribution the tokens were sampled from, which is what the trainer scores. The model's own ``generation_config`` is ignored during rollout:
transformers 5 would otherwise fill unset fields (repetition penalty, min_p, ...) from it and silently change the
sampling distribution.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, GenerationConfig

from rlpipe.algos.logprobs import scoring_temperature
from rlpipe.errors import ConfigError
from rlpipe.rollout.engine import Generation, SamplingParams, truncate_at_stop


class HFRolloutEngine:
    """``RolloutEngine`` over an HF causal LM (plain or FSDP2-wrapped) via ``model.generate``."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_id: int, batch_size: int = 64):
        if batch_size < 1:
            raise ConfigError(f"rollout batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.eos_token_id = int(eos_token_id)
        self.batch_size = batch_size

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        stop = [self.eos_token_id] + [t for t in params.stop_token_ids if t != self.eos_token_id]
        return GenerationConfig(
            do_sample=not params.greedy,
            # greedy: leave sampling knobs unset (the model's own generation_config is swapped out, so unset stays unset)
            temperature=None if params.greedy else params.temperature,
            top_p=None if params.greedy else params.top_p,
            top_k=None if params.greedy else params.top_k,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=stop,
            pad_token_id=self.pad_token_id,
            bos_token_id=None,
            num_beams=1,
            repetition_penalty=1.0,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
        )

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            if r:
                ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
                mask[i, width - len(r) :] = 1
        dev = self._device()
        return ids.to(dev), mask.to(dev)

    @torch.no_grad()
    def _generate_batch(
        self, prompts: list[list[int]], n: int, gen_cfg: GenerationConfig, temperature: float = 1.0
    ) -> tuple[list[list[int]], list[list[float]]]:
        """``n`` samples of each prompt, rows in (prompt, sample) order; the prompt prefill is shared by its samples."""
        ids, mask = self._left_pad(prompts)
        cache = self._prefill_prefix(ids, mask, n) if n > 1 and ids.shape[1] > 1 else None
        ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
        extra = {"cache": cache} if cache is not None else {}
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg, **extra)
        new = out.sequences[:, ids.shape[1] :]  # [B, S]
        # Raw logits per step -> tempered logprob of the sampled token, step by step (never [B, S, V] in fp32 at once).
        lps = torch.stack(
            [
                torch.log_softmax(_tempered(step.float(), temperature), dim=-1)
                .gather(-1, new[:, t : t + 1])
                .squeeze(-1)
                for t, step in enumerate(out.logits)
            ],
            dim=1,
        )
        return new.cpu().tolist(), lps.cpu().tolist()

    def _prefill_prefix(self, ids: torch.Tensor, mask: torch.Tensor, n: int) -> DynamicCache:
        """KV cache of every prompt but its last token, computed once and repeated ``n`` times along the batch.

        ``generate`` then feeds only the uncached last token; positions follow generate's own rule for left padding
        (cumsum of the mask minus one, 1 on padding), so the cached keys equal those of an unshared prefill.
        """
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1], cache=cache,
                   use_cache=True, logits_to_keep=1)  # fmt: skip
        cache.batch_repeat_interleave(n)
        return cache

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Sample ``params.n`` responses per prompt; same model, prompts, params and batch_size => same samples."""
        for i, p in enumerate(prompts):
            if not p:
                raise ConfigError(f"rollout: prompt {i} is empty (a prompt needs at least one token, e.g. BOS)")
        # Prompts per generate call: batch_size rows, but never less than one whole group.
        per_call = max(1, self.batch_size // params.n)
        gen_cfg = self._generation_config(params)
        temperature = scoring_temperature(params.temperature)
        stop_ids = set(gen_cfg.eos_token_id)
        model = self.model
        was_training = model.training
        saved_gen_cfg = getattr(model, "generation_config", None)
        model.eval()
        model.generation_config = GenerationConfig(pad_token_id=self.pad_token_id, eos_token_id=self.eos_token_id)
        results: list[Generation] = []
        dev = self._device()
        try:
            # fork_rng: a rollout must not advance the caller's global RNG (the trainer's dropout/shuffle streams).
            cuda_ids = (
                [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
            )
            with torch.random.fork_rng(devices=cuda_ids):
                torch.manual_seed(params.seed)
                for start in range(0, len(prompts), per_call):
                    chunk = [
                        (pi, si) for pi in range(start, min(start + per_call, len(prompts))) for si in range(params.n)
                    ]
                    toks, lps = self._generate_batch(prompts[start : start + per_call], params.n, gen_cfg, temperature)
                    for (pi, si), t, lp in zip(chunk, toks, lps, strict=True):
                        resp, resp_lp, reason = truncate_at_stop(t, lp, stop_ids, self.eos_token_id)
                        results.append(Generation(pi, si, resp, resp_lp, reason))
        finally:
            model.generation_config = saved_gen_cfg
            model.train(was_training)
        return results


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature``, untouched at 1 (bit-identical to the untempered logprobs)."""
    return logits if temperature == 1.0 else logits / temperature
