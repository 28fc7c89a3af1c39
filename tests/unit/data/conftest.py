"""A small character-level tokenizer with a chat template, built here so data tests need no model code."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlpipe.data.builtin_tasks import builtin_charset

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_char_tokenizer(with_template: bool = True) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in builtin_charset() + "ABCXYZ.,!":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    if with_template:
        hf.chat_template = CHAT_TEMPLATE
    return hf


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_char_tokenizer()


@pytest.fixture(scope="session")
def make_tokenizer():
    """The builder itself, for tests that need a variant (e.g. no chat template)."""
    return make_char_tokenizer
