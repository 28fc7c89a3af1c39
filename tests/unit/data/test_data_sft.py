"""SFT dataset loading: chat and prompt/response rows, EOS handling, loss only on the last assistant turn."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlpipe.data.packing import pack_sequences
from rlpipe.data.sft import load_sft_dataset, sft_sequence_items
from rlpipe.errors import ConfigError, DataError


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_messages_row_trains_last_assistant_turn(tmp_path: Path, tokenizer) -> None:
    chat = [
        {"role": "user", "content": "add 1+1"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "add 2+2"},
        {"role": "assistant", "content": "4"},
    ]
    ds = load_sft_dataset(write_jsonl(tmp_path / "s.jsonl", [{"messages": chat}]), tokenizer, 128)
    ex = ds[0]
    expected_prompt = tokenizer.apply_chat_template(chat[:3], add_generation_prompt=True, tokenize=False)
    assert ex.prompt_ids == ids(tokenizer, expected_prompt)
    assert ex.response_ids == ids(tokenizer, "4") + [tokenizer.eos_token_id]
    assert ex.row == 0 and len(ds.content_hash) == 64


def test_prompt_response_rows_parquet_and_no_eos(tmp_path: Path, tokenizer) -> None:
    rows = [
        {"prompt": [{"role": "user", "content": "reverse 123"}], "response": "321"},
        {"prompt": [{"role": "user", "content": "add 1+2"}], "response": "3"},
    ]
    path = tmp_path / "s.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds = load_sft_dataset(path, tokenizer, 64, append_eos=False)
    assert [e.response_ids for e in ds.examples] == [ids(tokenizer, "321"), ids(tokenizer, "3")]
    ref = tokenizer.apply_chat_template(rows[1]["prompt"], add_generation_prompt=True, tokenize=False)
    assert ds[1].prompt_ids == ids(tokenizer, ref)
    # plain-text prompt == single user turn
    ds2 = load_sft_dataset(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "add 1+2", "response": "3"}]), tokenizer, 64)
    assert ds2[0].prompt_ids == ds[1].prompt_ids


def test_sft_items_label_only_the_response(tmp_path: Path, tokenizer) -> None:
    rows = [{"prompt": "add 1+2", "response": "3"}, {"prompt": "reverse 12", "response": "21"}]
    ds = load_sft_dataset(write_jsonl(tmp_path / "s.jsonl", rows), tokenizer, 64)
    items = sft_sequence_items(ds.select([1, 0, 1]))  # a repeated example still gets its own row
    assert [it.row for it in items] == [0, 1, 2] and all(it.advantage == 1.0 for it in items)
    packs = pack_sequences(items, 64, tokenizer.pad_token_id)
    labelled = sorted(int(x) for p in packs for x in p.shifted_labels[p.shifted_labels != -100])
    expected = sorted(t for ex in ds.select([1, 0, 1]) for t in ex.response_ids)
    assert labelled == expected
    assert sum(float(p.advantages.sum()) for p in packs) == len(expected)


BAD = [
    ("missing_both", {"text": "x"}, "prompt"),
    ("missing_response", {"prompt": "add 1+1"}, "response"),
    ("response_wrong_type", {"prompt": "add 1+1", "response": 2}, "response"),
    ("empty_response", {"prompt": "add 1+1", "response": " "}, "response"),
    ("empty_prompt", {"prompt": "", "response": "2"}, "prompt"),
    ("messages_not_list", {"messages": "hi"}, "messages"),
    (
        "messages_last_not_assistant",
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
        "messages",
    ),
    ("messages_only_assistant", {"messages": [{"role": "assistant", "content": "a"}]}, "messages"),
    ("too_long", {"prompt": "add 1+1", "response": "9" * 60}, "response"),
]


@pytest.mark.parametrize(("case", "bad", "field"), BAD, ids=[c[0] for c in BAD])
def test_bad_rows(tmp_path: Path, tokenizer, case: str, bad: dict, field: str) -> None:
    good = {"prompt": "add 1+1", "response": "2"}
    path = write_jsonl(tmp_path / f"{case}.jsonl", [good, bad])
    with pytest.raises(DataError) as err:
        load_sft_dataset(path, tokenizer, 48)
    msg = str(err.value)
    assert str(path) in msg and "row 1" in msg and f"field {field!r}" in msg, msg


def test_config_errors(tmp_path: Path, tokenizer, make_tokenizer) -> None:
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "add 1+1", "response": "2"}])
    with pytest.raises(ConfigError):
        load_sft_dataset(path, tokenizer, 1)
    with pytest.raises(ConfigError, match="chat_template"):
        load_sft_dataset(path, make_tokenizer(with_template=False), 48)
    raw = load_sft_dataset(path, make_tokenizer(with_template=False), 48, apply_chat_template=False)
    assert raw[0].prompt_ids == ids(tokenizer, "add 1+1")
