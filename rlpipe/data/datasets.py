"""Prompt datasets for RL: verl-style parquet/jsonl rows -> tokenized prompts with their ground truth.

Columns (names configurable):
- ``prompt``: either a list of chat messages ``[{"role": ..., "content": ...}, ...]`` or a plain string.
  Messages are rendered with ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``. A plain
  string becomes a single user turn and goes through the same template when ``apply_chat_template=True``
  (default); with ``apply_chat_template=False`` the string is tokenized verbatim (no special tokens added), for
  base models prompted with raw text.
- ``ground_truth``: top-level column, or verl's ``reward_model: {"ground_truth": ...}`` (top-level wins; a missing,
  None or NaN top-level value falls back to it, else it is a DataError naming the row). Numbers become their text,
  a whole float as its integer (``10.0`` -> ``"10"``: what pandas makes of an int column with a missing value must
  still match ``10``); anything else that is not a string is a DataError.
- ``data_source`` (optional, default ``"unknown"``) selects the judge; ``extra_info`` (optional dict) is passed to it.

Every problem raises ``DataError`` naming the file, row and field. Rendering then encoding with
``add_special_tokens=False`` gives the same ids as ``apply_chat_template(..., tokenize=True)`` (that is what HF does
internally) and lets us keep the rendered text for logs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlpipe.data.reading import read_rows
from rlpipe.errors import ConfigError, DataError

DEFAULT_DATA_SOURCE = "unknown"


@dataclass
class PromptExample:
    """One tokenized prompt and what the judge needs to score a response to it."""

    prompt_ids: list[int]
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any]
    row: int  # index of the row in the source file (0-based; for jsonl: the n-th non-blank line)
    prompt_text: str  # the rendered prompt (after the chat template), for logs and debugging


@dataclass
class PromptDataset:
    """Examples of one source file plus the sha256 of its bytes (recorded in checkpoint lineage)."""

    path: str
    examples: list[PromptExample]
    content_hash: str
    skipped_rows: list[int] = field(default_factory=list)  # rows dropped by skip_overlong

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> PromptExample:
        return self.examples[index]

    def select(self, indices: Sequence[int]) -> list[PromptExample]:
        """Examples at the given dataset indices (what a sampler batch maps to)."""
        return [self.examples[i] for i in indices]


def _check_chat_template(tokenizer: Any) -> None:
    """A chat prompt needs a template; fail once, up front, with a fix rather than per row."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "tokenizer has no chat_template; set one or load with apply_chat_template=False (plain-text prompts only)"
        )


def _validate_messages(value: list[Any], *, file: str, row: int, field: str) -> list[dict[str, Any]]:
    """Chat messages must be a non-empty list of {"role": str, "content": str} dicts."""
    if not value:
        raise DataError("empty prompt (no messages)", file=file, row=row, field=field)
    messages: list[dict[str, Any]] = []
    for k, msg in enumerate(value):
        if not isinstance(msg, Mapping):
            raise DataError(f"message {k} is a {type(msg).__name__}, expected a dict", file=file, row=row, field=field)
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not role:
            raise DataError(f"message {k} has no string 'role'", file=file, row=row, field=field)
        if not isinstance(content, str):
            raise DataError(
                f"message {k} 'content' is {type(content).__name__}, expected str", file=file, row=row, field=field
            )
        messages.append({key: v for key, v in msg.items() if v is not None})
    if not any(m["content"].strip() for m in messages):
        raise DataError("empty prompt (all messages are blank)", file=file, row=row, field=field)
    return messages


def render_prompt(
    value: Any, tokenizer: Any, *, apply_chat_template: bool, file: str, row: int, field: str
) -> tuple[list[int], str]:
    """Turn a ``prompt`` cell (messages or text) into (token ids, rendered text); see the module docstring."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError("empty prompt", file=file, row=row, field=field)
        if not apply_chat_template:
            text = value
        else:
            text = _apply_template(tokenizer, [{"role": "user", "content": value}], file=file, row=row, field=field)
    elif isinstance(value, list | tuple):
        if not apply_chat_template:
            raise DataError(
                "prompt is a list of chat messages but apply_chat_template=False", file=file, row=row, field=field
            )
        messages = _validate_messages(list(value), file=file, row=row, field=field)
        text = _apply_template(tokenizer, messages, file=file, row=row, field=field)
    else:
        raise DataError(
            f"prompt is {type(value).__name__}, expected a string or a list of chat messages",
            file=file,
            row=row,
            field=field,
        )
    ids = encode_text(tokenizer, text)
    if not ids:
        raise DataError("prompt tokenizes to zero tokens", file=file, row=row, field=field)
    return ids, text


def _apply_template(tokenizer: Any, messages: list[dict[str, Any]], *, file: str, row: int, field: str) -> str:
    """Render messages with the generation prompt appended; template errors become DataErrors for this row."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja raises its own error types (e.g. raise_exception in a template)
        raise DataError(f"chat template failed: {exc}", file=file, row=row, field=field) from exc
    if not isinstance(text, str):
        raise DataError(f"chat template returned {type(text).__name__}, expected str", file=file, row=row, field=field)
    return text


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` exactly as written (special tokens are not added; templates already carry them)."""
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _ground_truth(raw: Mapping[str, Any], key: str, *, file: str, row: int) -> str:
    """Top-level ground truth, else verl's reward_model.ground_truth; numbers become their text (`number_text`)."""
    value = raw.get(key)
    where = key
    if _is_missing(value):
        reward_model = raw.get("reward_model")
        if isinstance(reward_model, Mapping) and reward_model.get("ground_truth") is not None:
            value, where = reward_model["ground_truth"], "reward_model.ground_truth"
        elif reward_model is not None and not isinstance(reward_model, Mapping):
            raise DataError(
                f"reward_model is {type(reward_model).__name__}, expected a dict",
                file=file,
                row=row,
                field="reward_model",
            )
        else:
            raise DataError(f"missing column {key!r} (or reward_model.ground_truth)", file=file, row=row, field=key)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DataError(f"ground truth is {type(value).__name__}, expected str", file=file, row=row, field=where)
    if _is_missing(value) or (isinstance(value, float) and not math.isfinite(value)):
        raise DataError(f"ground truth is {value!r}, not a value a judge can match", file=file, row=row, field=where)
    return value if isinstance(value, str) else number_text(value)


def _is_missing(value: Any) -> bool:
    """None or NaN: pandas and jsonl's ``NaN`` spell a missing value as a float NaN, never a truth to match."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def number_text(value: int | float) -> str:
    """A number as a judge should see it: ints as themselves, a whole float as its integer (10.0 -> "10")."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _optional_str(raw: Mapping[str, Any], key: str, default: str, *, file: str, row: int) -> str:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, str) or not value:
        raise DataError(f"expected a non-empty string, got {type(value).__name__}", file=file, row=row, field=key)
    return value


def _optional_dict(raw: Mapping[str, Any], key: str, *, file: str, row: int) -> dict[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise DataError(f"expected a dict, got {type(value).__name__}", file=file, row=row, field=key)
    return dict(value)


def load_prompt_dataset(
    path: str | Path,
    tokenizer: Any,
    max_prompt_length: int,
    prompt_key: str = "prompt",
    ground_truth_key: str = "ground_truth",
    data_source_key: str = "data_source",
    extra_info_key: str = "extra_info",
    *,
    apply_chat_template: bool = True,
    default_data_source: str = DEFAULT_DATA_SOURCE,
    skip_overlong: bool = False,
) -> PromptDataset:
    """Load and tokenize a prompt file (parquet or jsonl by suffix).

    A prompt longer than ``max_prompt_length`` tokens is a DataError, unless ``skip_overlong`` (then its row is
    listed in ``skipped_rows``; a file where every row is skipped is still an error).
    """
    if max_prompt_length <= 0:
        raise ConfigError(f"max_prompt_length must be positive, got {max_prompt_length}")
    if apply_chat_template:
        _check_chat_template(tokenizer)
    table = read_rows(path)
    name = table.path
    examples: list[PromptExample] = []
    skipped: list[int] = []
    for row, raw in enumerate(table.rows):
        if prompt_key not in raw or raw[prompt_key] is None:
            raise DataError(f"missing column {prompt_key!r}", file=name, row=row, field=prompt_key)
        ids, text = render_prompt(
            raw[prompt_key], tokenizer, apply_chat_template=apply_chat_template, file=name, row=row, field=prompt_key
        )
        ground_truth = _ground_truth(raw, ground_truth_key, file=name, row=row)
        data_source = _optional_str(raw, data_source_key, default_data_source, file=name, row=row)
        extra_info = _optional_dict(raw, extra_info_key, file=name, row=row)
        if len(ids) > max_prompt_length:
            if skip_overlong:
                skipped.append(row)
                continue
            raise DataError(
                f"prompt has {len(ids)} tokens, more than max_prompt_length={max_prompt_length}",
                file=name,
                row=row,
                field=prompt_key,
            )
        examples.append(PromptExample(ids, ground_truth, data_source, extra_info, row, text))
    if not examples:
        raise DataError(f"all {len(skipped)} prompts exceed max_prompt_length={max_prompt_length}", file=name)
    return PromptDataset(path=name, examples=examples, content_hash=table.content_hash, skipped_rows=skipped)
