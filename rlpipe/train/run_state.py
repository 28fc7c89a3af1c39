"""A run's state besides the weights: its counters and lineage, how they become a checkpoint and come back from one.

`RunState.save` assembles a checkpoint (the workers' DCP save, `train_state.json`, the config, an optional HF export,
the lineage manifest) atomically; `resume` continues a checkpoint's run on this run's world size; `init_weights_from`
starts a new stage from a checkpoint's weights only. Checkpoints written before the counters were unified (format 1
of `train_state.json`) load through `TrainState`'s migration.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rlpipe.config import PipelineConfig
from rlpipe.data.sampler import EpochSampler
from rlpipe.errors import CheckpointError
from rlpipe.train import checkpoint as ckpt
from rlpipe.train.checkpoint_io import capture_rng_state, restore_rng_state
from rlpipe.train.lineage import (
    BaseModelRef,
    DataRef,
    ServedRef,
    build_manifest,
    model_architecture,
    model_fingerprint,
    model_weights_sha256,
)

SaveHook = Callable[[Path], dict]  # hook(tmp_dir) -> entries merged into train_state.json's `extra`


class RunState:
    """Counters and lineage of one run (the session's), and its checkpoints."""

    def __init__(self, cfg: PipelineConfig, model_dir: str, log=print):
        self.cfg, self.model_dir, self.log = cfg, model_dir, log
        self.counters = ckpt.Counters()
        self.parent: str | None = None
        self.parent_weights_only = False  # the next checkpoint's parent gave only its weights (checkpoint.init_from)
        self.data: list[dict] = []  # data consumed since the last checkpoint (lineage)
        self.served: list[dict] = []  # weights a server engine served since then (lineage)
        self.save_hooks: list[SaveHook] = []

    # ------------------------------------------------------------------ lineage
    def record_data(self, role: str, iteration: int, path: str, sha256: str | None) -> None:
        """Note that `iteration` read `path` in `role`. A run of iterations reading the same file is one entry
        (`prompts@301-400`), not one per iteration: a segment of 100 iterations would otherwise list it 100 times."""
        for entry in reversed(self.data):
            name, _, span = entry["name"].partition("@")
            if name == role:
                if entry["path"] == path and entry["sha256"] == sha256:
                    entry["name"] = f"{role}@{span.split('-')[0]}-{iteration}"
                    return
                break
        self.data.append({"name": f"{role}@{iteration}", "path": path, "sha256": sha256})

    def record_served(self, iteration: int, engine: str, version: int) -> None:
        """Note that `iteration`'s rollouts came from `engine` serving weight `version`; consecutive iterations from
        the same engine share one entry."""
        if self.served and self.served[-1]["engine"] == engine:
            start = self.served[-1]["iterations"].split("-")[0]
            self.served[-1]["iterations"] = f"{start}-{iteration}"
            self.served[-1]["weight_versions"].append(version)
            return
        self.served.append({"iterations": str(iteration), "engine": engine, "weight_versions": [version]})

    # ------------------------------------------------------------------ checkpoints
    def verify(self, checkpoint: str) -> None:
        """Checksums, and the same model shape: a mismatch names the config fields that differ."""
        ckpt.verify_checkpoint(
            checkpoint,
            expect_model_fingerprint=model_fingerprint(self.model_dir),
            expect_model_name=self.model_dir,
            expect_architecture=model_architecture(self.model_dir),
            expect_weights_sha256=self._weights_sha256(),
        )

    def _weights_sha256(self) -> str | None:
        """The base weights' hash for LoRA runs (their checkpoints hold only adapters); None otherwise."""
        return model_weights_sha256(self.model_dir) if self.cfg.model.lora.enabled else None

    def save(self, phase: str, metrics: dict | None, controller, tokenizer, samplers: Samplers) -> str:
        """Write a complete checkpoint atomically and return its path; it becomes the parent of the next one."""
        tmp = ckpt.begin_checkpoint(self.cfg.checkpoint.root, self.cfg.experiment, self.counters.step)
        try:
            state = self._train_state(controller.save(str(tmp / ckpt.WEIGHTS_DIR)), samplers)
            for hook in self.save_hooks:  # e.g. rlpipe.loop_async: the batches sampled ahead of the trainer
                state.extra.update(hook(tmp))
            ckpt.write_train_state(tmp, state)
            ckpt.write_config(tmp, self.cfg.model_dump(mode="json"))
            if self.cfg.checkpoint.save_hf:  # a servable model dir: weights and the tokenizer (vLLM/SGLang need both)
                controller.save_hf(str(tmp / ckpt.HF_DIR))
                tokenizer.save_pretrained(str(tmp / ckpt.HF_DIR))
            final = ckpt.finalize_checkpoint(tmp, self._manifest(phase, metrics))
        except BaseException:
            ckpt.abort_checkpoint(tmp)
            raise
        self.parent = absolute(final)  # a relative root must still resolve when read from elsewhere
        self.parent_weights_only = False
        self.data, self.served = [], []
        return str(final)

    def _train_state(self, worker_states: list[dict], samplers: Samplers) -> ckpt.TrainState:
        return ckpt.TrainState(
            counters=self.counters.model_copy(),
            sampler=samplers.prompts.state(),
            sft_sampler=samplers.sft.state() if samplers.sft else None,
            rng_states=[capture_rng_state()],  # the driver's; each worker's own is in worker_states
            worker_states=worker_states,
        )

    def _manifest(self, phase: str, metrics: dict | None):
        c = self.counters
        return build_manifest(
            experiment=self.cfg.experiment,
            step=c.step,
            iteration=c.iteration,
            base_model=BaseModelRef(
                path=absolute(self.model_dir),
                fingerprint=model_fingerprint(self.model_dir),
                architecture=model_architecture(self.model_dir),
                weights_sha256=self._weights_sha256(),
            ),
            parent=self.parent,
            parent_weights_only=self.parent_weights_only,
            data=[DataRef(**d) for d in self.data],
            served=[ServedRef(**d) for d in self.served],
            config=self.cfg.model_dump(mode="json"),
            metrics={k: v for k, v in (metrics or {}).items() if isinstance(v, int | float)},
            phase=phase,
        )

    def resume(self, checkpoint: str, controller, samplers: Samplers) -> None:
        """Continue the checkpoint's run, on this run's world size (which may differ from the checkpoint's)."""
        path = Path(checkpoint)
        state = ckpt.load_train_state(path)
        if len(state.worker_states) != controller.world_size:
            self.log(f"resuming {path} (written by {len(state.worker_states)} workers) on "
                     f"{controller.world_size}: weights, optimizer, counters and samplers continue; the workers' "
                     "RNG is re-seeded (bitwise continuation needs the same world size)")  # fmt: skip
        controller.load(str(path / ckpt.WEIGHTS_DIR), state.worker_states)
        self.counters = state.counters.model_copy()
        samplers.prompts.load_state_dict(state.sampler)
        if samplers.sft is not None:
            if state.sft_sampler is None:
                raise CheckpointError(f"{path}: sft is enabled but the checkpoint has no SFT sampler state")
            samplers.sft.load_state_dict(state.sft_sampler)
        restore_rng_state(state.rng_states[0])
        self.parent = absolute(path)

    def init_weights_from(self, checkpoint: str, controller) -> None:
        """A new stage (`checkpoint.init_from`): the checkpoint's weights, with a fresh optimizer, LR schedule,
        counters, samplers and RNG; its first checkpoint names this one as a weights-only parent."""
        controller.load(str(Path(checkpoint) / ckpt.WEIGHTS_DIR), None)
        self.parent, self.parent_weights_only = absolute(checkpoint), True


class Samplers:
    """The run's prompt sampler and (with SFT on) its SFT sampler: what a checkpoint saves of the data stream."""

    def __init__(self, prompts: EpochSampler, sft: EpochSampler | None):
        self.prompts, self.sft = prompts, sft


def absolute(location: str | Path) -> str:
    """Manifest locations (`parent`, `base_model.path`) are stored absolute (URIs as they are): a manifest is read
    from any working directory."""
    text = str(location)
    return text if "://" in text else str(Path(text).resolve())
