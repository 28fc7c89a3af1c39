"""The built-in char tokenizer: exact round-trip, compact chat format, save/load through AutoTokenizer."""

from __future__ import annotations

import string

import pytest
from transformers import AutoTokenizer

from rlpipe.models.tokenizer import CHARS, SPECIAL_TOKENS, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_special_token_ids_are_distinct_and_first(tok):
    ids = [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id]
    assert len(set(ids)) == 4
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(len(SPECIAL_TOKENS)))
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARS)


@pytest.mark.parametrize(
    "text",
    ["reverse 123", "  two  spaces  ", "line1\nline2\n", "tab\there", string.digits + string.ascii_letters, "", " "],
)
def test_exact_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=True)
    assert len(ids) == len(text)  # one token per character, nothing added
    assert tok.decode(ids) == text


def test_every_char_is_one_known_token(tok):
    for c in CHARS:
        ids = tok.encode(c)
        assert len(ids) == 1 and ids[0] != tok.unk_token_id, repr(c)
    assert all(c in CHARS for c in string.punctuation + string.ascii_letters + string.digits + " \n")


def test_unknown_char_maps_to_unk(tok):
    assert tok.encode("aé") == [tok.convert_tokens_to_ids("a"), tok.unk_token_id]


def test_chat_template_prompt_and_assistant_turn(tok):
    msgs = [{"role": "user", "content": "reverse 123"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|user|>reverse 123<|assistant|>"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert ids[0] == tok.bos_token_id and len(ids) == 2 + len("reverse 123") + 1
    assert tok.decode(ids) == text
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "321"}], tokenize=False)
    assert full == "<s><|user|>reverse 123<|assistant|>321</s>"


def test_special_tokens_in_text_are_single_ids(tok):
    assert tok.encode("<s>ab</s>") == [tok.bos_token_id, tok.encode("a")[0], tok.encode("b")[0], tok.eos_token_id]
    assert tok.decode(tok.encode("<s>ab</s>"), skip_special_tokens=True) == "ab"


def test_left_padding(tok):
    out = tok(["ab", "abcd"], padding=True)
    assert out["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert out["attention_mask"][0] == [0, 0, 1, 1]


def test_save_pretrained_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    sample = "Hello,  world!\n reverse 99"
    assert tok2.encode(sample) == tok.encode(sample)
    assert tok2.decode(tok2.encode(sample)) == sample
    msgs = [{"role": "user", "content": "sort 312"}]
    assert tok2.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False) == tok.apply_chat_template(
        msgs, add_generation_prompt=True, return_dict=False
    )
    assert (tok2.pad_token_id, tok2.bos_token_id, tok2.eos_token_id) == (0, 1, 2)
    assert tok2.padding_side == "left"
