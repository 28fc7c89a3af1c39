"""The base policy of a run: the user's model directory, or the tiny default built (and warm-started) once.

RL needs a policy that sometimes succeeds; a randomly initialised model never does, so the tiny default gets a
short SFT warm-start on demonstrations of the built-in task. The result is cached under `output_dir/base-models/`
keyed by everything that determines it, written to a temporary directory and renamed when complete.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import torch

from rlpipe.algos.logprobs import chunked_cross_entropy
from rlpipe.config import PipelineConfig
from rlpipe.data.builtin_tasks import tiny_task_names, write_task_dataset
from rlpipe.data.packing import pack_sequences
from rlpipe.data.sampler import EpochSampler
from rlpipe.data.sft import load_sft_dataset, sft_sequence_items
from rlpipe.errors import ConfigError
from rlpipe.io import stable_hash
from rlpipe.models.loading import load_model, load_tokenizer
from rlpipe.models.packed import lm_head_weight, packed_hidden_states
from rlpipe.models.tiny import create_tiny_model_dir

_COMPLETE = "BASE_MODEL_COMPLETE"


def prepare_base_model(cfg: PipelineConfig, log=print) -> str:
    """Return the model directory every phase loads (building the tiny default when `model.path` is None)."""
    if cfg.model.path is not None:
        path = Path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path {path} is not a HF model directory (no config.json)")
        return str(path)
    if cfg.data.task is not None and cfg.data.task not in tiny_task_names():
        raise ConfigError(
            f"data.task={cfg.data.task!r} is not sized for the tiny default model (its charset and lengths); "
            f"set model.path to a pretrained model, or use one of {tiny_task_names()}"
        )
    key = stable_hash(
        {
            "tiny": cfg.model.tiny.model_dump(),
            "task": cfg.data.task,
            "seed": cfg.train.seed,
            "steps": cfg.model.warmup_sft_steps,
            "bs": cfg.model.warmup_sft_batch_size,
            "lr": cfg.model.warmup_sft_lr,
        }
    )[:12]
    final = Path(cfg.output_dir) / "base-models" / f"tiny-{cfg.data.task}-{key}"
    if (final / _COMPLETE).is_file():
        return str(final)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        create_tiny_model_dir(tmp, cfg.model.tiny, seed=cfg.train.seed)
        if cfg.model.warmup_sft_steps > 0:
            warm_start(tmp, cfg, log)
        (tmp / _COMPLETE).write_text("ok\n")
        if final.exists():  # a concurrent run finished first; keep theirs
            shutil.rmtree(tmp)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(final)


def warm_start(model_dir: Path, cfg: PipelineConfig, log=print) -> float:
    """A few hundred SFT steps on the built-in task's demonstrations, in-process; returns the final loss."""
    torch.manual_seed(cfg.train.seed)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, "float32", "cpu")
    model.config.use_cache = False
    data_file = model_dir / "warmup_sft.jsonl"
    # Demonstrations use a different seed than the RL prompts, so RL is not graded on memorised answers.
    write_task_dataset(cfg.data.task, 4000, cfg.data.seed + 7919, data_file, kind="sft")
    examples = load_sft_dataset(data_file, tokenizer, cfg.sft.max_length).examples
    data_file.unlink()
    sampler = EpochSampler(len(examples), cfg.model.warmup_sft_batch_size, seed=cfg.train.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.model.warmup_sft_lr)
    start, loss_value = time.perf_counter(), float("nan")
    model.train()
    for step in range(cfg.model.warmup_sft_steps):
        items = sft_sequence_items([examples[i] for i in sampler.next_batch()])
        packs = pack_sequences(items, cfg.train.pack_max_length, tokenizer.pad_token_id, pad_to_max_length=False)
        tokens = sum(p.num_label_tokens for p in packs)
        loss = sum(
            chunked_cross_entropy(
                packed_hidden_states(model, p.input_ids, p.position_ids, p.cu_seq_lens, check=False),
                lm_head_weight(model),
                p.shifted_labels,
                cfg.algo.chunk_size,
            )
            for p in packs
        ) / max(tokens, 1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_value = float(loss.item())
        if step % 50 == 0 or step == cfg.model.warmup_sft_steps - 1:
            log(f"warm-up SFT step {step + 1}/{cfg.model.warmup_sft_steps} loss {loss_value:.3f}")
    log(f"warm-up SFT done in {time.perf_counter() - start:.1f}s")
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    return loss_value
