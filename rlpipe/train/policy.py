"""The policy as one nn.Module whose forward returns per-token logprobs of a pack, and its FSDP2 sharding.

Wrapping the HF model lets FSDP2 treat the whole logprob computation as the root forward: embeddings, final norm
and LM head are unsharded for the duration of that forward, so the chunked logprob can read the LM head weight
directly instead of materialising [tokens, vocab] logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from rlpipe.data.packing import Pack
from rlpipe.models.packed import token_logprobs

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy


class PolicyModel(nn.Module):
    """`forward(pack tensors) -> logprobs [L]` over a HF causal LM, at `temperature` (RL: the sampling one; SFT: 1)."""

    def __init__(self, hf_model: nn.Module, chunk_size: int, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.hf = hf_model
        self.chunk_size = chunk_size
        self.autocast_dtype = autocast_dtype  # replicated mixed precision (`autocast_dtype`); None: parameter dtype
        self.sp_group = None  # `train.sp_size` > 1: the sp process group each pack's tokens are split over

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seq_lens: torch.Tensor,
        shifted_labels: torch.Tensor,
        prefix_of: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        with torch.autocast(input_ids.device.type, self.autocast_dtype, enabled=self.autocast_dtype is not None):
            out = token_logprobs(self.hf, input_ids, position_ids, cu_seq_lens, shifted_labels, self.chunk_size,
                                 prefix_of, temperature, self.sp_group)  # fmt: skip
        return out.clone()  # FSDP2 warns about (and mishandles in-place ops on) a view returned from forward

    def logprobs(self, pack: Pack, temperature: float = 1.0) -> torch.Tensor:
        return self(pack.input_ids, pack.position_ids, pack.cu_seq_lens, pack.shifted_labels, pack.prefix_of,
                    temperature=temperature)  # fmt: skip


def decoder_layers(hf_model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (each becomes its own FSDP2 unit)."""
    layers = getattr(hf_model.get_decoder(), "layers", None)
    if layers is None:
        raise NotImplementedError(f"{type(hf_model).__name__}: cannot find decoder layers to shard")
    return list(layers)


SMALL_MODEL_BYTES = 1 << 30
"""Below this many bytes of parameters the `auto` settings favour speed over memory: the policy is replicated
instead of sharded (`TrainConfig.fsdp`), and a sharded one keeps its gathered weights from forward to backward
(`TrainConfig.fsdp_reshard_after_forward`)."""


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def resolve_small_model_auto(setting: bool | str, model: nn.Module) -> bool:
    """`auto` -> True when the model's parameters take at least `SMALL_MODEL_BYTES`; booleans as given."""
    return parameter_bytes(model) >= SMALL_MODEL_BYTES if setting == "auto" else bool(setting)


def shard_policy(
    policy: PolicyModel, mesh, reshard_after_forward: bool | str = True, mp_policy: MixedPrecisionPolicy | None = None
) -> PolicyModel:
    """FSDP2: one unit per decoder layer plus the root (embeddings, norm, head) over the dp mesh.

    ``reshard_after_forward="auto"`` resolves to False for policies under ``SMALL_MODEL_BYTES`` (see
    ``TrainConfig.fsdp_reshard_after_forward``). ``mp_policy``: see ``mixed_precision_policy``; None keeps the
    parameter dtype for compute and reductions.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    reshard_after_forward = resolve_small_model_auto(reshard_after_forward, policy)
    for layer in decoder_layers(policy.hf):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    fully_shard(policy, mesh=mesh, mp_policy=mp_policy)
    return policy


def mixed_precision_policy(setting: str) -> MixedPrecisionPolicy | None:
    """FSDP2 policy for `train.mixed_precision` on a sharded policy.

    bf16: each unit all-gathers its fp32 shards as bf16 and computes in bf16 (norms, attention and MLP alike);
    gradients are reduce-scattered in fp32 into the fp32 shards, so master weights and AdamW states stay fp32.
    """
    if setting == "off":
        return None
    if setting != "bf16":
        raise ValueError(f"train.mixed_precision={setting!r}: expected off or bf16")
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def autocast_dtype(setting: str) -> torch.dtype | None:
    """`PolicyModel.autocast_dtype` for `train.mixed_precision` on a replicated or single-process policy.

    Why autocast rather than a bf16 copy of the weights: the fp32 parameters stay the only copy the optimizer and
    the gradient all-reduce see (gradients arrive in fp32 through autocast's differentiable casts, so the
    replicated all-reduce sums fp32 as FSDP2's reduce_dtype does), and there is no second module to keep in sync.
    Autocast runs matmuls (linear, attention) in bf16 and keeps norms, softmax and residual adds in fp32, so it is
    slightly more precise than FSDP2's all-bf16 compute; the chunked logprob disables it (fp32 logits).
    """
    if setting == "off":
        return None
    if setting != "bf16":
        raise ValueError(f"train.mixed_precision={setting!r}: expected off or bf16")
    return torch.bfloat16


def apply_activation_checkpointing(hf_model: nn.Module) -> None:
    """Recompute every decoder layer's forward in backward instead of storing its activations.

    torch's composable ``checkpoint`` (non-reentrant, hooks on the layer) rather than ``checkpoint_wrapper``: it
    leaves the module tree and parameter names alone, so DCP checkpoints, ``copy_policy_into`` and the serving
    export see the same names with and without it. Applied before ``fully_shard``, so FSDP2's per-layer unshard
    runs inside the checkpointed region and again in the recompute (what torch's FSDP2 AC tests exercise).
    """
    from torch.distributed._composable import checkpoint

    for layer in decoder_layers(hf_model):
        checkpoint(layer, preserve_rng_state=True)


def compile_decoder_layers(hf_model: nn.Module) -> None:
    """torch.compile each decoder layer's forward in place.

    The layer's ``forward`` is replaced rather than wrapping the module (``torch.compile(module)`` adds an
    ``_orig_mod.`` prefix to every parameter name), so module hooks (FSDP2's unshard, activation checkpointing)
    stay outside the compiled graph and names stay stable.
    """
    for layer in decoder_layers(hf_model):
        layer.forward = torch.compile(layer.forward)


def apply_layer_options(hf_model: nn.Module, activation_checkpointing: bool, compile_layers: bool) -> None:
    """`train.activation_checkpointing` and `train.compile` on the decoder layers (before any sharding)."""
    if activation_checkpointing:
        apply_activation_checkpointing(hf_model)
    if compile_layers:
        compile_decoder_layers(hf_model)


def shard_reference(ref: PolicyModel, mesh, offload: bool = False) -> PolicyModel:
    """FSDP2 for the frozen KL reference: the policy's units (one per decoder layer plus the root), each gathered for
    its forward and resharded right after (there is no backward to keep them for), so a rank holds 1/dp of the
    reference plus one gathered layer at a time.

    ``offload``: FSDP2 ``CPUOffloadPolicy``: the shards live in CPU memory and each unit is copied to the device
    only while it is gathered (``TrainConfig.ref_offload``). Call ``reshard_root`` after the forwards.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    ref.eval().requires_grad_(False)
    policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    for layer in decoder_layers(ref.hf):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, offload_policy=policy)
    fully_shard(ref, mesh=mesh, reshard_after_forward=True, offload_policy=policy)
    return ref


def reshard_root(model: nn.Module) -> None:
    """Free the gathered root unit (embeddings, norm, head) of an FSDP2 model after no-grad forwards.

    FSDP2 keeps the root gathered after forward, expecting the backward to need it; a model that is only scored
    (the reference) would otherwise hold its full embeddings until the next forward.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def load_sharded_weights(
    model: PolicyModel, model_dir: str, device: str | torch.device, buffer_device: str | torch.device | None = None
) -> None:
    """Fill a meta-initialised, FSDP2-sharded PolicyModel from ``model_dir``'s safetensors, each rank reading only
    its own shards (``rlpipe.models.loading``): no rank materialises the full model."""
    from rlpipe.models.loading import load_safetensors_into, materialize

    materialize(model, device, buffer_device)  # on the FSDP2 root: its `_apply` re-registers the sharded params
    load_safetensors_into(model.hf, model_dir)


def full_hf_state_dict(policy: PolicyModel) -> dict[str, torch.Tensor]:
    """Unsharded HF-named weights on every rank (a collective: all ranks must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True))
    return {name.removeprefix("hf."): tensor for name, tensor in state.items()}


def copy_policy_into(policy: PolicyModel, hf_model: nn.Module) -> None:
    """Copy the policy's current weights into an unsharded HF model (the rollout copy); a collective under FSDP2.

    Under FSDP2 each sharded unit is unsharded (one all-gather per unit, as a forward does), copied and resharded:
    ~5x cheaper than a full-state-dict gather per parameter (one-off timing: 18 ms -> 4 ms for the tiny model on
    gloo), and it runs every RL iteration before rollout.
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in policy.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        copy_weights_into(hf_model, {name.removeprefix("hf."): p for name, p in policy.named_parameters()})
    finally:
        for unit in units:
            unit.reshard()


def copy_weights_into(hf_model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into `hf_model` parameter by parameter (tied weights are visited once)."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.copy_(state[name].to(param.device, param.dtype))
