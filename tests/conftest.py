"""Shared fixtures: an isolated HOME (Flyte's local cache), one local Ray for the session, tiny configs."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def random_items(seed: int, rows: int, response_lengths: tuple[int, int]) -> list:
    """`rows` SequenceItems with 6 prompt tokens, a response length drawn from [low, high), random advantages and
    rollout logprobs: the packed batches of the worker-level unit tests (same seed, same items)."""
    import torch

    from rlpipe.data.packing import SequenceItem

    g = torch.Generator().manual_seed(seed)
    items = []
    for row in range(rows):
        r = int(torch.randint(*response_lengths, (1,), generator=g))
        items.append(
            SequenceItem(
                prompt_ids=torch.randint(5, 40, (6,), generator=g).tolist(),
                response_ids=torch.randint(5, 40, (r,), generator=g).tolist(),
                advantage=float(torch.randn(1, generator=g)),
                rollout_logprobs=(-torch.rand(r, generator=g) * 3).tolist(),
                row=row,
            )
        )
    return items


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for every test that needs workers (starting Ray costs ~7 s)."""
    import ray

    from rlpipe.ray_env import ensure_ray

    ensure_ray()
    yield ray
    ray.shutdown()


def tiny_overrides(tmp_path, **extra) -> dict:
    """A config small enough for a test: 4 prompts x 4 samples, tiny model, short warm-up."""
    base = {
        "output_dir": str(tmp_path / "out"),
        "checkpoint.root": str(tmp_path / "ckpt"),
        "iterations": 4,
        "segment_size": 4,
        "rollout.prompts_per_step": 4,
        "rollout.n": 4,
        "rollout.max_new_tokens": 6,
        "model.warmup_sft_steps": 20,
        "train.pack_max_length": 128,
        "train.world_size": 1,
    }
    base.update(extra)
    return base


def in_process_worker(cfg, model_dir: str):
    """A TrainingWorker without a process group (world size 1): what `setup` builds, minus init_process_group."""
    import torch

    from rlpipe.models.loading import load_model
    from rlpipe.train.optim import build_optimizer
    from rlpipe.train.policy import PolicyModel
    from rlpipe.train.worker import TrainingWorker

    threads = torch.get_num_threads()
    w = TrainingWorker(cfg.model_dump_json(), model_dir, 0, 1)
    torch.set_num_threads(threads)  # __init__ pins the worker's threads; do not slow the test process down
    torch.manual_seed(0)
    w.policy = PolicyModel(load_model(model_dir), cfg.algo.chunk_size)
    w.policy.hf.config.use_cache = False
    w.policy.train()
    w.optimizer = build_optimizer(w.policy.parameters(), cfg.train)
    w.ref, w.rollout_model, w._rollout_stale = None, None, True
    w.optimizer_step, w.skipped_steps = 0, 0
    return w


def vllm_python_or_skip() -> str:
    """The vLLM venv's python (scripts/setup_vllm.sh); without it the calling test module skips, unless
    RLPIPE_REQUIRE_VLLM=1 (CI), where a missing venv is an error, not a skip."""
    import os
    from pathlib import Path

    python = os.environ.get("RLPIPE_VLLM_PYTHON") or str(Path(__file__).resolve().parents[1] / ".venv-vllm/bin/python")
    if not Path(python).is_file():
        if os.environ.get("RLPIPE_REQUIRE_VLLM") == "1":
            raise RuntimeError(f"RLPIPE_REQUIRE_VLLM=1 but there is no vLLM venv python at {python}")
        pytest.skip(f"no vLLM venv at {python}: run `bash scripts/setup_vllm.sh`", allow_module_level=True)
    return python
