"""The data files of a run: the user's parquet/jsonl, or a built-in task's rows written once and read back the same way.

One loader for train and held-out prompts (they differ only in the file and, for built-in tasks, the split), one for
SFT examples. Built-in task rows go through the user-data path too, so both are read, validated and hashed alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from rlpipe.config import PipelineConfig
from rlpipe.data.builtin_tasks import write_task_dataset
from rlpipe.data.datasets import PromptDataset, load_prompt_dataset
from rlpipe.data.sft import SFTDataset, load_sft_dataset
from rlpipe.io import inside_root

EVAL_SEED_OFFSET = 104729  # held-out prompts of a built-in task use another generator seed
SFT_SEED_OFFSET = 7

Split = Literal["train", "eval"]


def builtin_task_file(cfg: PipelineConfig, kind: str, n: int, seed: int, split: Split = "train") -> Path:
    """A built-in task's rows as parquet under `output_dir/data`, written on first use. ``split="eval"`` draws
    held-out problems (disjoint from every train problem for tasks that support it)."""
    suffix = "" if split == "train" else f"-{split}"
    path = inside_root(cfg.output_dir, "data", f"{cfg.data.task}-{kind}-n{n}-seed{seed}{suffix}.parquet")
    if not path.exists():
        write_task_dataset(cfg.data.task, n, seed, path, kind=kind, split=split)
    return path


def prompt_file(cfg: PipelineConfig, split: Split) -> Path:
    """`data.path` / `data.eval_path`, else the built-in task's file of that split."""
    d = cfg.data
    given = d.path if split == "train" else d.eval_path
    if given:
        return Path(given)
    if split == "train":
        return builtin_task_file(cfg, "rl", d.num_prompts, d.seed)
    return builtin_task_file(cfg, "rl", d.num_eval_prompts, d.seed + EVAL_SEED_OFFSET, split="eval")


def load_prompts(cfg: PipelineConfig, tokenizer, split: Split = "train") -> PromptDataset:
    """The run's train or held-out prompts, tokenized (`data.*` says how)."""
    d = cfg.data
    return load_prompt_dataset(
        prompt_file(cfg, split),
        tokenizer,
        d.max_prompt_length,
        prompt_key=d.prompt_key,
        apply_chat_template=d.apply_chat_template,
    )


def load_sft(cfg: PipelineConfig, tokenizer) -> SFTDataset:
    """The SFT demonstrations: `sft.path`, else the built-in task's."""
    s = cfg.sft
    path = Path(s.path) if s.path else builtin_task_file(cfg, "sft", s.num_examples, cfg.data.seed + SFT_SEED_OFFSET)
    return load_sft_dataset(path, tokenizer, s.max_length)
