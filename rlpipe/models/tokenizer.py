"""Character-level tokenizer for the built-in synthetic tasks.

Built offline from the `tokenizers` library (no download): every printable ASCII character is one token, so
decode(encode(s)) == s exactly (spaces and newlines included), and the tiny default model needs no pretrained
vocabulary. The chat template is deliberately compact (one token per role marker) because the built-in tasks are
short strings such as ``reverse 123``.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SYSTEM_TOKEN = "<|system|>"
UNK_TOKEN = "<unk>"

# Order fixes the ids: pad=0, bos=1, eos=2, ...; kept stable because saved tiny models depend on it.
SPECIAL_TOKENS: list[str] = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, UNK_TOKEN, SYSTEM_TOKEN]

# Printable ASCII minus vertical tab / form feed (they never occur in task text and confuse whitespace handling).
CHARS: list[str] = [c for c in string.printable if c not in "\x0b\x0c"]

# Prompt: <s><|user|>{content}<|assistant|> ; an assistant turn is {content}</s>. System turns use <|system|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ '<|system|>' + message['content'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def tiny_vocab() -> dict[str, int]:
    """Token -> id map: special tokens first, then one id per character."""
    tokens = SPECIAL_TOKENS + CHARS
    return {tok: i for i, tok in enumerate(tokens)}


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer (offline, deterministic).

    WordLevel over a char vocabulary + a pre-tokenizer that isolates every character + a Fuse decoder that
    concatenates tokens without separators, so text round-trips byte for byte. Special tokens are registered as
    added tokens so that the rendered chat template (which contains ``<s>`` etc. as text) maps to single ids.
    """
    vocab = tiny_vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
