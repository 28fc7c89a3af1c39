"""Load HF causal LMs and tokenizers from local directories, with errors a user can act on.

Security default: ``trust_remote_code=False`` (no code from a model dir runs unless the config asks for it).
Weights come from safetensors when the dir has them (transformers prefers them).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

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


def empty_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """The architecture of the model in ``path`` with its parameters on the meta device (no memory, no values) and
    its buffers real (eval mode).

    Why buffers real: non-persistent buffers such as RoPE's ``inv_freq`` are computed in ``__init__`` and are not
    in the weights file, so a fully-meta model would lose them. Fill the parameters with ``materialize`` and
    ``load_safetensors_into`` (after FSDP2 sharding, so each rank only ever allocates its own shards).
    """
    from accelerate import init_empty_weights

    p = _model_dir(path)
    try:
        config = AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code, local_files_only=True)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype),
                                                     trust_remote_code=trust_remote_code,
                                                     attn_implementation=attn_implementation)  # fmt: skip
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot build model from {str(p)!r}: {e}") from e
    model.tie_weights()  # init_empty_weights re-registers every parameter, which unties shared ones: tie them again
    model.eval()
    return model


def materialize(model: nn.Module, device: str | torch.device, buffer_device: str | torch.device | None = None) -> None:
    """Allocate the meta parameters of ``model`` on ``device`` (uninitialised; load them next) and keep the values
    of its buffers, moved to ``buffer_device`` (default ``device``).

    Call it on the FSDP2 root when the model is sharded: ``to_empty`` then allocates only each rank's shards.
    ``buffer_device`` differs from ``device`` for CPU-offloaded FSDP2 units (shards on CPU, compute on the GPU).
    """
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    aliases = _shared_parameters(model)
    model.to_empty(device=device)
    for module, leaf, source in aliases:  # a plain (unsharded) to_empty gives each alias its own tensor: re-tie
        if getattr(module, leaf) is not (shared := model.get_parameter(source)):
            setattr(module, leaf, shared)
    target = torch.device(buffer_device or device)
    for name, value in saved.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value.to(target)


def _shared_parameters(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(module, attribute, name of the first owner) for every parameter that is an alias of an earlier one (tied
    embeddings)."""
    first: dict[int, str] = {}
    aliases = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for leaf, param in module._parameters.items():
            if param is None:
                continue
            name = f"{prefix}.{leaf}" if prefix else leaf
            if id(param) in first:
                aliases.append((module, leaf, first[id(param)]))
            else:
                first[id(param)] = name
    return aliases


def has_safetensors(path: str | Path) -> bool:
    return any(Path(path).glob("*.safetensors"))


def load_safetensors_into(model: nn.Module, path: str | Path) -> None:
    """Copy the weights of the safetensors in ``path`` into ``model``'s parameters in place (and into any persistent
    buffer the files hold), converting dtypes.

    The parameters may be FSDP2-sharded DTensors: each rank reads only the rows of its own shards, straight into
    them (``rlpipe.models.shard_reader``), so no rank holds the full model or a mapped copy of the file. Tied
    parameters are one parameter (listed once, under the name the file keeps). A model with LoRA adapters
    (``rlpipe.models.lora``) gets its base weights (``q_proj.base_layer.weight`` <- ``q_proj.weight``); the adapters
    are not in the files and are left for ``init_adapter_weights``.
    """
    from rlpipe.models.lora import base_weight_name, is_adapter_param
    from rlpipe.models.shard_reader import load_rows, read_index

    p = _model_dir(path)
    if not has_safetensors(p):
        raise ConfigError(
            f"sharded loading (train.fsdp) reads safetensors, and {str(p)!r} has none; re-save the model with "
            "save_pretrained(..., safe_serialization=True)"
        )
    in_files = read_index(p)
    state = {base_weight_name(n): t for n, t in model.named_parameters() if not is_adapter_param(n)}
    state.update({name: b for name, b in model.named_buffers() if name in in_files})
    load_rows(state, in_files, p)


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
