"""Load HF causal LMs and tokenizers from local directories, with errors a user can act on.

Security default: ``trust_remote_code=False`` (no code from a model dir runs unless the config asks for it).
Weights come from safetensors when the dir has them (transformers prefers them).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlpipe.errors import ConfigError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a config string (``float32``/``bfloat16``/``float16`` or short forms) to a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPES)}") from None


def _model_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"model directory {str(p)!r} does not exist (expected a local HF model dir)")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model directory {str(p)!r} has no config.json; is it an HF model dir?")
    return p


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """Load a causal LM from a local dir onto ``device`` in ``dtype`` (eval mode; the trainer sets train mode)."""
    p = _model_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(p),
            dtype=resolve_dtype(dtype),
            trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation,
            local_files_only=True,
        )
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot load model from {str(p)!r}: {e}") from e
    model.to(device)
    model.eval()
    return model


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved next to a model; left padding (what batched generation needs)."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"tokenizer directory {str(p)!r} does not exist")
    try:
        tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot load tokenizer from {str(p)!r}: {e}") from e
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ConfigError(f"tokenizer in {str(p)!r} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token  # common for chat models; padding is masked out anyway
    return tok


def check_tokenizer_matches(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, where: str = "") -> None:
    """Raise ConfigError when the tokenizer can emit ids the model has no embedding for.

    A model embedding may be larger than the tokenizer (padded vocab), never smaller.
    """
    emb = model.get_input_embeddings().weight.shape[0]
    n = len(tokenizer)
    if n > emb:
        at = f" ({where})" if where else ""
        raise ConfigError(
            f"tokenizer/model mismatch{at}: tokenizer has {n} tokens but the model embedding has only {emb} rows; "
            "were the tokenizer and the model taken from different checkpoints?"
        )


def load_model_and_tokenizer(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
    tokenizer_path: str | Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load both and check they belong together (``tokenizer_path`` defaults to the model dir)."""
    model = load_model(path, dtype, device, trust_remote_code, attn_implementation)
    tok = load_tokenizer(tokenizer_path or path, trust_remote_code)
    check_tokenizer_matches(model, tok, where=f"model {path}, tokenizer {tokenizer_path or path}")
    return model, tok
