"""SFT datasets: (prompt, response) token pairs whose loss covers only the response.

Two row shapes (parquet or jsonl, same error rules as prompt datasets):
- ``messages``: a chat. The last message must be an assistant turn: it is the response; every earlier turn
  (earlier assistant turns included) is rendered with the chat template and ``add_generation_prompt=True`` as the
  prompt. So only the final assistant turn is trained on — a multi-turn chat teaches its last answer only.
- ``prompt`` + ``response``: the prompt is a string or chat messages (handled as in
  :mod:`rlpipe.data.datasets`), the response a non-empty string.

The response is tokenized verbatim and, with ``append_eos=True`` (default), followed by the EOS token: that is
exactly what a rollout produces (generation after the generation prompt, stopped by EOS), so SFT and RL train the
same token layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.data.datasets import _apply_template, _check_chat_template, _validate_messages, encode_text, render_prompt
from rlpipe.data.packing import SequenceItem
from rlpipe.data.reading import read_rows
from rlpipe.errors import ConfigError, DataError


@dataclass
class SFTExample:
    """One tokenized SFT pair; ``row`` is its index in the source file."""

    prompt_ids: list[int]
    response_ids: list[int]
    row: int


@dataclass
class SFTDataset:
    """Examples of one SFT file plus the sha256 of its bytes (for lineage)."""

    path: str
    examples: list[SFTExample]
    content_hash: str

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> SFTExample:
        return self.examples[index]

    def select(self, indices: Sequence[int]) -> list[SFTExample]:
        """Examples at the given dataset indices (what a sampler batch maps to)."""
        return [self.examples[i] for i in indices]


def _from_messages(value: Any, tokenizer: Any, *, file: str, row: int, field: str) -> tuple[list[int], str]:
    """Split a chat into (prompt ids, final assistant text)."""
    if not isinstance(value, list | tuple):
        raise DataError(f"messages is {type(value).__name__}, expected a list", file=file, row=row, field=field)
    messages = _validate_messages(list(value), file=file, row=row, field=field)
    if len(messages) < 2:
        raise DataError(
            "a chat needs at least one turn before the final assistant turn", file=file, row=row, field=field
        )
    last = messages[-1]
    if last["role"] != "assistant":
        raise DataError(
            f"the last message must be an assistant turn, got role {last['role']!r}", file=file, row=row, field=field
        )
    prompt_text = _apply_template(tokenizer, messages[:-1], file=file, row=row, field=field)
    prompt_ids = encode_text(tokenizer, prompt_text)
    if not prompt_ids:
        raise DataError("prompt tokenizes to zero tokens", file=file, row=row, field=field)
    return prompt_ids, last["content"]


def load_sft_dataset(
    path: str | Path,
    tokenizer: Any,
    max_length: int,
    messages_key: str = "messages",
    prompt_key: str = "prompt",
    response_key: str = "response",
    *,
    apply_chat_template: bool = True,
    append_eos: bool = True,
) -> SFTDataset:
    """Load and tokenize an SFT file; prompt + response longer than ``max_length`` tokens is a DataError."""
    if max_length <= 1:
        raise ConfigError(f"max_length must be at least 2, got {max_length}")
    eos = getattr(tokenizer, "eos_token_id", None)
    if append_eos and eos is None:
        raise ConfigError("tokenizer has no eos_token_id; set one or pass append_eos=False")
    table = read_rows(path)
    name = table.path
    needs_template = any(messages_key in r for r in table.rows) or apply_chat_template
    if needs_template:
        _check_chat_template(tokenizer)
    examples: list[SFTExample] = []
    for row, raw in enumerate(table.rows):
        if raw.get(messages_key) is not None:
            prompt_ids, response_text = _from_messages(
                raw[messages_key], tokenizer, file=name, row=row, field=messages_key
            )
            resp_field = messages_key
        else:
            for key in (prompt_key, response_key):
                if raw.get(key) is None:
                    raise DataError(
                        f"missing column {key!r} (rows need {messages_key!r} or {prompt_key!r}+{response_key!r})",
                        file=name,
                        row=row,
                        field=key,
                    )
            prompt_ids, _ = render_prompt(
                raw[prompt_key],
                tokenizer,
                apply_chat_template=apply_chat_template,
                file=name,
                row=row,
                field=prompt_key,
            )
            response_text, resp_field = raw[response_key], response_key
        if not isinstance(response_text, str):
            raise DataError(
                f"response is {type(response_text).__name__}, expected str", file=name, row=row, field=resp_field
            )
        if not response_text.strip():
            raise DataError("empty response", file=name, row=row, field=resp_field)
        response_ids = encode_text(tokenizer, response_text) + ([int(eos)] if append_eos else [])
        total = len(prompt_ids) + len(response_ids)
        if total > max_length:
            raise DataError(
                f"prompt+response has {total} tokens, more than max_length={max_length}",
                file=name,
                row=row,
                field=resp_field,
            )
        examples.append(SFTExample(prompt_ids, response_ids, row))
    return SFTDataset(path=name, examples=examples, content_hash=table.content_hash)


def sft_sequence_items(examples: Sequence[SFTExample]) -> list[SequenceItem]:
    """SFT pairs as packing items: advantage 1.0 and no rollout logprobs, so the policy-gradient token layout
    (labels on the response only) gives plain cross-entropy. ``row`` is the position in ``examples`` (unique even
    if a batch holds the same example twice)."""
    return [
        SequenceItem(prompt_ids=list(ex.prompt_ids), response_ids=list(ex.response_ids), advantage=1.0, row=i)
        for i, ex in enumerate(examples)
    ]
