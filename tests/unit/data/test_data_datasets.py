"""Prompt dataset loading: column conventions, tokenization, lineage hash and every bad-input DataError."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlpipe.data.datasets import load_prompt_dataset
from rlpipe.errors import ConfigError, DataError


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


ROWS = [
    {"prompt": [{"role": "user", "content": "add 1+2"}], "ground_truth": "3", "data_source": "rlpipe/add"},
    {"prompt": "reverse 123", "reward_model": {"style": "rule", "ground_truth": "321"}},
    {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count a in aab"}],
        "ground_truth": 2,
        "extra_info": {"index": 7},
    },
]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_loads_both_formats_with_verl_columns(tmp_path: Path, tokenizer, suffix: str) -> None:
    path = tmp_path / f"p{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, ROWS)
    else:
        # parquet needs one schema: give every row every column
        rows = [
            {**{"ground_truth": None, "data_source": None, "extra_info": None, "reward_model": None}, **r} for r in ROWS
        ]
        rows[1]["prompt"] = [{"role": "user", "content": "reverse 123"}]
        rows[2]["ground_truth"] = "2"
        write_parquet(path, rows)
    ds = load_prompt_dataset(path, tokenizer, max_prompt_length=64)
    assert len(ds) == 3
    assert [e.ground_truth for e in ds.examples] == ["3", "321", "2"]
    assert [e.data_source for e in ds.examples] == ["rlpipe/add", "unknown", "unknown"]
    assert ds[2].extra_info == {"index": 7} and ds[0].extra_info == {}
    assert [e.row for e in ds.examples] == [0, 1, 2]
    assert ds.content_hash == hashlib.sha256(path.read_bytes()).hexdigest()
    # ids equal HF's own tokenize=True path; plain text == single user turn
    for example, raw in zip(ds.examples, ROWS, strict=True):
        msgs = raw["prompt"] if isinstance(raw["prompt"], list) else [{"role": "user", "content": raw["prompt"]}]
        ref = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ref_ids = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        assert example.prompt_ids == list(ref_ids)
        assert example.prompt_text == tokenizer.decode(example.prompt_ids)
        assert example.prompt_text.endswith("<|assistant|>")
    assert ds.select([2, 0]) == [ds[2], ds[0]]


def test_top_level_ground_truth_wins_and_raw_text_mode(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "add 1+2=", "ground_truth": "3", "reward_model": {"ground_truth": "x"}}]
    )
    ds = load_prompt_dataset(path, tokenizer, 64, apply_chat_template=False)
    assert ds[0].ground_truth == "3"
    assert ds[0].prompt_text == "add 1+2="
    assert ds[0].prompt_ids == tokenizer("add 1+2=", add_special_tokens=False)["input_ids"]


def test_custom_keys_and_hash_changes_with_content(tmp_path: Path, tokenizer) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"q": "add 1+1", "answer": "2", "src": "s"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"q": "add 1+2", "answer": "3", "src": "s"}])
    kw = dict(prompt_key="q", ground_truth_key="answer", data_source_key="src")
    da, db = load_prompt_dataset(a, tokenizer, 64, **kw), load_prompt_dataset(b, tokenizer, 64, **kw)
    assert da[0].data_source == "s" and da[0].ground_truth == "2"
    assert da.content_hash != db.content_hash


def test_skip_overlong(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "add 1+1", "ground_truth": "2"}, {"prompt": "x" * 80, "ground_truth": "y"}]
    )
    ds = load_prompt_dataset(path, tokenizer, 32, skip_overlong=True)
    assert len(ds) == 1 and ds.skipped_rows == [1]
    with pytest.raises(DataError, match="exceed"):
        load_prompt_dataset(
            write_jsonl(tmp_path / "q.jsonl", [{"prompt": "x" * 80, "ground_truth": "y"}]),
            tokenizer,
            32,
            skip_overlong=True,
        )


GOOD = {"prompt": "add 1+1", "ground_truth": "2"}

BAD_ROWS = [
    ("missing_prompt", {"ground_truth": "2"}, "prompt"),
    ("missing_gt", {"prompt": "add 1+1"}, "ground_truth"),
    ("prompt_wrong_type", {"prompt": 5, "ground_truth": "2"}, "prompt"),
    ("empty_prompt", {"prompt": "   ", "ground_truth": "2"}, "prompt"),
    ("empty_messages", {"prompt": [], "ground_truth": "2"}, "prompt"),
    ("message_not_dict", {"prompt": ["hi"], "ground_truth": "2"}, "prompt"),
    ("message_no_role", {"prompt": [{"content": "hi"}], "ground_truth": "2"}, "prompt"),
    ("message_content_list", {"prompt": [{"role": "user", "content": ["a"]}], "ground_truth": "2"}, "prompt"),
    ("gt_wrong_type", {"prompt": "add 1+1", "ground_truth": ["2"]}, "ground_truth"),
    ("gt_bool", {"prompt": "add 1+1", "ground_truth": True}, "ground_truth"),
    ("reward_model_not_dict", {"prompt": "add 1+1", "reward_model": "2"}, "reward_model"),
    (
        "nested_gt_wrong_type",
        {"prompt": "add 1+1", "reward_model": {"ground_truth": {"a": 1}}},
        "reward_model.ground_truth",
    ),
    ("data_source_wrong_type", {"prompt": "add 1+1", "ground_truth": "2", "data_source": 3}, "data_source"),
    ("extra_info_wrong_type", {"prompt": "add 1+1", "ground_truth": "2", "extra_info": [1]}, "extra_info"),
    ("too_long", {"prompt": "1" * 100, "ground_truth": "2"}, "prompt"),
]


@pytest.mark.parametrize(("case", "bad", "field"), BAD_ROWS, ids=[c[0] for c in BAD_ROWS])
def test_bad_row_names_file_row_field(tmp_path: Path, tokenizer, case: str, bad: dict, field: str) -> None:
    path = write_jsonl(tmp_path / f"{case}.jsonl", [GOOD, GOOD, bad])
    with pytest.raises(DataError) as err:
        load_prompt_dataset(path, tokenizer, max_prompt_length=48)
    msg = str(err.value)
    assert str(path) in msg and "row 2" in msg and f"field {field!r}" in msg, msg
    assert err.value.row == 2 and err.value.field == field and err.value.file == str(path)


def test_messages_with_apply_chat_template_false(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": "a"}], "ground_truth": "b"}])
    with pytest.raises(DataError, match="apply_chat_template=False") as err:
        load_prompt_dataset(path, tokenizer, 48, apply_chat_template=False)
    assert err.value.row == 0


def test_invalid_json_line_and_non_object(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + '{"prompt": "add 1+1", \n', encoding="utf-8")
    with pytest.raises(DataError) as err:
        load_prompt_dataset(path, tokenizer, 48)
    assert str(path) in str(err.value) and "row 1" in str(err.value) and "line 3" in str(err.value)
    write_jsonl(path, [GOOD, [1, 2]])
    with pytest.raises(DataError, match="expected an object") as err:
        load_prompt_dataset(path, tokenizer, 48)
    assert err.value.row == 1


def test_non_utf8_line(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "latin.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"prompt": "caf\xe9", "ground_truth": "1"}\n')
    with pytest.raises(DataError, match="UTF-8") as err:
        load_prompt_dataset(path, tokenizer, 48)
    assert err.value.row == 1 and str(path) in str(err.value)


def test_truncated_parquet_and_bad_suffix_and_empty(tmp_path: Path, tokenizer) -> None:
    good = write_parquet(tmp_path / "good.parquet", [GOOD] * 20)
    data = good.read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="parquet") as err:
        load_prompt_dataset(cut, tokenizer, 48)
    assert str(cut) in str(err.value)
    with pytest.raises(DataError, match="suffix") as err:
        load_prompt_dataset(tmp_path / "data.csv", tokenizer, 48)
    assert "data.csv" in str(err.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="no rows"):
        load_prompt_dataset(empty, tokenizer, 48)
    with pytest.raises(DataError, match="cannot read"):
        load_prompt_dataset(tmp_path / "missing.jsonl", tokenizer, 48)


def test_tokenizer_without_template_is_config_error(tmp_path: Path, make_tokenizer) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD])
    tok = make_tokenizer(with_template=False)
    with pytest.raises(ConfigError, match="chat_template"):
        load_prompt_dataset(path, tok, 48)
    assert load_prompt_dataset(path, tok, 48, apply_chat_template=False)[0].prompt_text == "add 1+1"
