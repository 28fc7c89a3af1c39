"""The cross-field rules of a PipelineConfig: values each valid alone that cannot run together.

Kept beside `rlpipe.config` (which calls `check_consistency` from its model validator) so the field definitions and
the rules between them each stay one short file. Every rule raises ValueError; pydantic turns it into the
ConfigError `rlpipe.config.validate_config` raises, naming the keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlpipe.config import PipelineConfig


def check_consistency(cfg: PipelineConfig) -> None:
    """Every cross-field rule, in the order a user is most likely to trip them."""
    if cfg.train.mixed_precision != "off" and cfg.model.dtype != "float32":
        raise ValueError(
            f"train.mixed_precision={cfg.train.mixed_precision} keeps float32 master weights and computes in "
            f"bf16; model.dtype={cfg.model.dtype} would make the master weights low precision too: set "
            "model.dtype=float32 (or mixed_precision=off to train fully in that dtype)"
        )
    if cfg.data.path is None and cfg.data.task is None:
        raise ValueError("data: set either `path` (a prompt file) or `task` (a built-in task)")
    if cfg.sft.enabled and cfg.sft.path is None and cfg.data.task is None:
        raise ValueError("sft.enabled needs sft.path (an SFT file) or a built-in data.task to generate demos")
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if cfg.train.pack_max_length < longest:
        raise ValueError(
            f"train.pack_max_length={cfg.train.pack_max_length} cannot hold the longest sequence "
            f"(data.max_prompt_length + rollout.max_new_tokens = {longest})"
        )
    if cfg.rollout.engine == "openai" and not cfg.rollout.server_url:
        raise ValueError("rollout.engine=openai needs rollout.server_url")
    if cfg.rollout.engine == "sglang" and not (cfg.rollout.server_url or cfg.rollout.server_urls):
        raise ValueError("rollout.engine=sglang needs rollout.server_url (or rollout.server_urls)")
    _check_replicas(cfg)
    if cfg.rollout.engine == "openai" and not cfg.algo.rollout_is.enabled:
        raise ValueError(
            "rollout.engine=openai never gives the server new weights, so every rollout after the first update "
            "is off-policy: set algo.rollout_is.enabled=true to correct for it (see mismatch/* metrics), or use "
            "rollout.engine=vllm / sglang, which sync the weights after every update"
        )
    _check_staleness(cfg)
    max_model_len = cfg.rollout.vllm.max_model_len
    if cfg.rollout.engine == "vllm" and max_model_len is not None and max_model_len < longest:
        raise ValueError(
            f"rollout.vllm.max_model_len={cfg.rollout.vllm.max_model_len} is shorter than the longest sequence "
            f"(data.max_prompt_length + rollout.max_new_tokens = {longest})"
        )
    if cfg.rollout.engine == "sglang" and cfg.rollout.weight_sync.method == "nccl":
        raise ValueError("rollout.weight_sync.method=nccl is vLLM's transfer; sglang syncs from disk")
    _check_lora(cfg)
    if cfg.algo.advantage in ("grpo", "rloo") and cfg.rollout.n < 2:
        raise ValueError(f"algo.advantage={cfg.algo.advantage} needs rollout.n >= 2 (a group of one has no baseline)")
    _check_sequence_parallel(cfg)
    if cfg.rollout.prompts_per_step % cfg.dp_size != 0:
        raise ValueError("rollout.prompts_per_step must be a multiple of the data-parallel size")


def _check_replicas(cfg: PipelineConfig) -> None:
    """Several engine replicas: managed (rollout.vllm.replicas) or given (rollout.server_urls), not both."""
    r = cfg.rollout
    if r.server_urls and r.engine not in ("vllm", "sglang"):
        raise ValueError(f"rollout.server_urls is for synced engines (vllm, sglang), not rollout.engine={r.engine}")
    if r.server_urls and r.server_url:
        raise ValueError("rollout: give either server_url or server_urls, not both")
    managed = r.engine == "vllm" and not (r.server_url or r.server_urls)
    if r.vllm.replicas > 1 and not managed:
        raise ValueError("rollout.vllm.replicas > 1 starts managed vLLM servers: drop server_url / server_urls "
                         "(list your own servers in rollout.server_urls instead)")  # fmt: skip
    placed = managed and (r.vllm.replicas > 1 or r.vllm.resources)
    if placed and r.weight_sync.method == "nccl" and not r.vllm.resources.get("GPU"):
        raise ValueError("rollout.weight_sync.method=nccl streams GPU to GPU: managed replicas need a GPU each "
                         "(rollout.vllm.resources: {GPU: 1}); on CPU use method=disk")  # fmt: skip


def _check_sequence_parallel(cfg: PipelineConfig) -> None:
    """train.sp_size splits the world into sp groups and a pack's attention heads over a group's ranks."""
    sp, train = cfg.train.sp_size, cfg.train
    if sp == 1:
        return
    if train.world_size % sp:
        raise ValueError(f"train.world_size={train.world_size} must be a multiple of train.sp_size={sp} (dp x sp)")
    if cfg.model.attn_implementation != "sdpa" or not train.packed_attention:
        raise ValueError(
            f"train.sp_size={sp} runs Ulysses attention over rlpipe's packed sdpa: needs model.attn_implementation="
            f"sdpa (got {cfg.model.attn_implementation}) and train.packed_attention=true (got {train.packed_attention})"
        )
    heads = model_head_counts(cfg)
    if heads is not None:
        check_sp_heads(sp, *heads, source=cfg.model.path or "model.tiny")


def model_head_counts(cfg: PipelineConfig) -> tuple[int, int] | None:
    """(attention heads, kv heads) of the configured model: the tiny shape, or model.path's config.json when it can
    be read here (a path only the workers see is checked when they load it)."""
    if cfg.model.path is None:
        return cfg.model.tiny.num_heads, cfg.model.tiny.num_kv_heads
    import json
    from pathlib import Path

    try:
        hf = json.loads((Path(cfg.model.path) / "config.json").read_text())
        heads = int(hf["num_attention_heads"])
        return heads, int(hf.get("num_key_value_heads") or heads)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_sp_heads(sp: int, heads: int, kv_heads: int, source: str) -> None:
    """Ulysses attention gives each sp rank at least one query head (split as evenly as possible when sp does not
    divide them; kv heads are split or repeated to match, `rlpipe.models.sequence_parallel`)."""
    if sp > heads:
        raise ValueError(
            f"train.sp_size={sp} is more than the model's attention heads: {source} has num_attention_heads={heads} "
            f"and num_key_value_heads={kv_heads}; Ulysses attention needs at least one query head per sp rank"
        )


def check_model_sp_heads(hf_config, sp: int, source: str) -> None:
    """`check_sp_heads` on a loaded model's config (the workers' check of a model.path the driver could not read);
    raises ConfigError."""
    if sp == 1:
        return
    from rlpipe.errors import ConfigError

    heads = int(hf_config.num_attention_heads)
    try:
        check_sp_heads(sp, heads, int(getattr(hf_config, "num_key_value_heads", None) or heads), source)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_lora(cfg: PipelineConfig) -> None:
    """model.lora trains adapters over a frozen base: what the base-only or full-weight paths cannot do with it."""
    if not cfg.model.lora.enabled:
        return
    if cfg.train.ref_load_from:
        raise ValueError(
            "model.lora.enabled: the KL reference is the base model (the policy with its adapters off); "
            "train.ref_load_from cannot name another one"
        )
    if cfg.rollout.engine == "sglang":
        raise ValueError("model.lora.enabled with rollout.engine=sglang: adapter sync is implemented for vllm and hf")
    if cfg.rollout.weight_sync.method == "nccl":
        raise ValueError(
            "model.lora.enabled: the adapter is synced from disk (megabytes); rollout.weight_sync.method=nccl "
            "streams full weights: use method=disk"
        )


def _check_staleness(cfg: PipelineConfig) -> None:
    """rollout.max_staleness >= 1 overlaps a server's sampling with training, which only a synced server allows."""
    k = cfg.rollout.max_staleness
    if k == 0:
        return
    if cfg.rollout.engine not in ("vllm", "sglang"):
        why = (
            "the hf engine samples inside the training workers, so sampling and training cannot overlap"
            if cfg.rollout.engine == "hf"
            else "the openai engine is never synced, so its staleness is not bounded by k"
        )
        raise ValueError(
            f"rollout.max_staleness={k} needs a synced server engine (rollout.engine=vllm or sglang): {why}"
        )
    if not cfg.algo.rollout_is.enabled:
        raise ValueError(
            f"rollout.max_staleness={k} trains on batches sampled {k} update(s) ago: set "
            "algo.rollout_is.enabled=true so rollout importance sampling corrects for the older policy"
        )


def check_roots_writable(cfg: PipelineConfig) -> None:
    """The roots a run writes under can be created and written (checked before Ray, creating nothing).

    Why: an unwritable `checkpoint.root` used to fail at the first save, after a whole segment of training.
    """
    from rlpipe.io import check_writable_dir

    check_writable_dir(cfg.checkpoint.root, "checkpoint.root")
    check_writable_dir(cfg.output_dir, "output_dir")
    sync = cfg.rollout.weight_sync
    if cfg.rollout.engine in ("vllm", "sglang") and sync.method == "disk" and sync.dir:
        check_writable_dir(sync.dir, "rollout.weight_sync.dir")
