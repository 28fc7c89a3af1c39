"""Prompt/SFT datasets (parquet/jsonl), resumable samplers with JSON state, sequence packing, built-in tasks."""

from rlpipe.data.builtin_tasks import (
    BUILTIN_TASKS,
    SyntheticTask,
    builtin_charset,
    make_sft_rows,
    make_task_rows,
    task_names,
    write_task_dataset,
)
from rlpipe.data.datasets import PromptDataset, PromptExample, load_prompt_dataset
from rlpipe.data.packing import (
    IGNORE_INDEX,
    Pack,
    SequenceItem,
    dp_shards,
    efficient_attn_ratio,
    pack_sequences,
    pad_pack_to_length,
    pad_sequences,
    scatter_to_rows,
)
from rlpipe.data.sampler import EpochSampler
from rlpipe.data.sft import SFTDataset, SFTExample, load_sft_dataset, sft_sequence_items

__all__ = [
    "BUILTIN_TASKS",
    "IGNORE_INDEX",
    "Pack",
    "PromptDataset",
    "PromptExample",
    "EpochSampler",
    "SFTDataset",
    "SFTExample",
    "SequenceItem",
    "SyntheticTask",
    "builtin_charset",
    "efficient_attn_ratio",
    "load_prompt_dataset",
    "load_sft_dataset",
    "make_sft_rows",
    "make_task_rows",
    "pack_sequences",
    "pad_pack_to_length",
    "pad_sequences",
    "scatter_to_rows",
    "sft_sequence_items",
    "dp_shards",
    "task_names",
    "write_task_dataset",
]
