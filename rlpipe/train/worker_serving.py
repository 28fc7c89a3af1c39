"""The part of a training worker that hands its weights to a server engine: a serving directory on disk, or the
NCCL stream of the GPU path (`rlpipe.rollout.nccl_transfer`). Mixed into `TrainingWorker`, whose policy it reads."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from rlpipe.models.loading import load_model
from rlpipe.models.lora import adapter_state, is_adapter_param, peft_lora_config
from rlpipe.rollout.serving_dir import (
    model_dir_files,
    save_adapter,
    serving_buffer,
    serving_state_dict,
    write_adapter_dir,
    write_serving_dir,
)
from rlpipe.train.distributed import free_port
from rlpipe.train.policy import full_hf_state_dict

ADAPTER_DIR = "adapter"  # the peft adapter inside an export of a LoRA policy (the merged model is beside it)


class ServingExport:
    """Publishing methods of `TrainingWorker` (`policy`, `rank`, `model_dir` are the worker's)."""

    def export_serving(self, root: str, version: int) -> str | None:
        """Publish the policy for a server engine: a complete HF dir under `root` (a collective; rank 0 writes),
        or with LoRA only the adapter (a peft dir of megabytes; the server holds the base model).

        The LM head is written explicitly even when tied (`serving_state_dict` says why)."""
        if self.cfg.model.lora.enabled:
            return self._export_adapter(root, version)
        state = self._serving_state()
        return None if state is None else str(write_serving_dir(state, self.model_dir, root, version))

    def export_serving_buffer(self) -> np.ndarray | dict[str, bytes] | None:
        """The policy's `model.safetensors` in memory (a collective; rank 0 returns it): for engine replicas on
        other nodes, which each write their own local copy; Ray keeps it in rank 0's object store. With LoRA, the
        adapter directory's files by name instead (megabytes; the replicas hold the base model)."""
        if self.cfg.model.lora.enabled:
            state = self._adapter_tensors()
            if state is None:
                return None
            with tempfile.TemporaryDirectory(prefix="rlpipe-adapter-") as tmp:
                return model_dir_files(save_adapter(state, self._peft_config(), tmp))
        state = self._serving_state()
        return None if state is None else serving_buffer(state)

    def _serving_state(self) -> dict[str, torch.Tensor] | None:
        """Rank 0: every weight a server loads, the LM head written even when tied; other ranks join the gather."""
        state = full_hf_state_dict(self.policy)
        if self.rank != 0:
            return None
        hf = self.policy.hf
        names = {id(module): name for name, module in hf.named_modules()}
        embed, head = names.get(id(hf.get_input_embeddings())), names.get(id(hf.get_output_embeddings()))
        return serving_state_dict(state, embed and f"{embed}.weight", head and f"{head}.weight")

    def _export_adapter(self, root: str, version: int) -> str | None:
        """The adapter tensors only (a collective), as a peft dir under `root`; rank 0 writes."""
        state = self._adapter_tensors()
        return None if state is None else str(write_adapter_dir(state, self._peft_config(), root, version))

    def _adapter_tensors(self) -> dict[str, torch.Tensor] | None:
        """Rank 0: the peft-named adapter tensors (each gathered from its shards under FSDP2, so every rank joins)."""
        state = {}
        for name, param in self.policy.named_parameters():
            if is_adapter_param(name):
                full = param.full_tensor() if hasattr(param, "full_tensor") else param
                state[name.removeprefix("hf.")] = full.detach()
        return adapter_state(state) if self.rank == 0 else None

    def _peft_config(self):
        return peft_lora_config(self.cfg.model.lora, str(Path(self.model_dir).resolve()))

    def _save_lora_export(self, state: dict[str, torch.Tensor], out_dir: str) -> None:
        """Rank 0 writes the peft adapter to `out_dir/adapter` and the merged model (base + scaled B·A, through
        peft's `merge_and_unload`) to `out_dir`: one for serving beside the base, one standalone."""
        if self.rank != 0:
            return
        from peft import PeftModel

        out = Path(out_dir)
        config = peft_lora_config(self.cfg.model.lora, str(Path(self.model_dir).resolve()))
        save_adapter(adapter_state(state), config, out / ADAPTER_DIR)
        base = load_model(self.model_dir, self.cfg.model.dtype, "cpu", self.cfg.model.trust_remote_code)
        merged = PeftModel.from_pretrained(base, str(out / ADAPTER_DIR)).merge_and_unload()
        merged.save_pretrained(out_dir, safe_serialization=True)

    def _serving_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, parameter) of every weight a server loads, the LM head listed even when tied."""
        hf = self.policy.hf
        pairs = [(name.removeprefix("hf."), p) for name, p in self.policy.named_parameters()]
        names = {id(module): name for name, module in hf.named_modules()}
        head = names.get(id(hf.get_output_embeddings()))
        if head and all(n != f"{head}.weight" for n, _ in pairs):
            pairs.append((f"{head}.weight", hf.get_output_embeddings().weight))
        return pairs

    def init_weight_transfer(self, endpoints: list) -> tuple[str, int] | None:
        """Rank 0 joins one NCCL weight-transfer group with every server (`endpoints`: their `ControlEndpoint`s;
        GPU path, see rlpipe.rollout.nccl_transfer); returns the group's (address, port) on rank 0."""
        if self.rank != 0:
            return None
        import ray

        from rlpipe.rollout.nccl_transfer import NCCLWeightSender, join_weight_transfer, open_vllm_communicator

        addr, port = ray.util.get_node_ip_address(), free_port()
        communicator = join_weight_transfer(endpoints, addr, port, open_vllm_communicator)
        self._weight_sender = NCCLWeightSender(endpoints, communicator)
        return addr, port

    def send_weights_nccl(self, version: int, bucket_bytes: int) -> int:
        """Stream the policy to every server in buckets (a collective: under FSDP2 every rank gathers each bucket)."""
        from rlpipe.rollout.nccl_transfer import iter_buckets, send_or_drain

        def materialize(t: torch.Tensor) -> torch.Tensor:
            return t.full_tensor().detach() if hasattr(t, "full_tensor") else t.detach()

        buckets = iter_buckets(self._serving_parameters(), bucket_bytes, materialize)
        with torch.no_grad():
            if self.rank != 0:
                return sum(len(b) for b in buckets)  # join the gathers rank 0's buckets need
            return send_or_drain(self._weight_sender, buckets, version)
