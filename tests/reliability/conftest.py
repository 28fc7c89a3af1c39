"""Shared, expensive-once setup of the reliability suite: a tiny base model without warm-up, a fake checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlpipe.base_model import prepare_base_model
from rlpipe.config import load_config

from ..conftest import tiny_overrides


def fast_overrides(tmp_path: Path, **extra) -> dict:
    """`tiny_overrides` without the warm-up SFT (30+ s on 2 shared cores): reliability tests need no reward signal."""
    return tiny_overrides(tmp_path, **{"model.warmup_sft_steps": 0, **extra})


@pytest.fixture(scope="session")
def shared_out(tmp_path_factory) -> Path:
    """One output_dir for the whole suite, so the tiny base model is built once and then found in its cache."""
    root = tmp_path_factory.mktemp("rel-shared")
    cfg = load_config(overrides=fast_overrides(root))
    prepare_base_model(cfg, log=lambda _msg: None)
    return root


@pytest.fixture(scope="session")
def base_model_dir(shared_out) -> str:
    return prepare_base_model(load_config(overrides=fast_overrides(shared_out)), log=lambda _msg: None)


@pytest.fixture
def fake_checkpoint(tmp_path, base_model_dir):
    """A complete checkpoint written with the real checkpoint pieces but without Ray (a DCP save of a Linear)."""
    from rlpipe.train import checkpoint as ckpt
    from rlpipe.train import checkpoint_io as cio
    from rlpipe.train.lineage import BaseModelRef, build_manifest, model_fingerprint

    root = tmp_path / "ckpt"
    tmp = ckpt.begin_checkpoint(root, "exp", 3)
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    cio.save_dcp(layer, torch.optim.AdamW(layer.parameters()), tmp / ckpt.WEIGHTS_DIR)
    ckpt.write_train_state(tmp, ckpt.TrainState(step=3, iteration=3, rng_states=[cio.capture_rng_state()]))
    ckpt.write_config(tmp, {"experiment": "exp"})
    manifest = build_manifest(
        experiment="exp",
        step=3,
        iteration=3,
        base_model=BaseModelRef(path=base_model_dir, fingerprint=model_fingerprint(base_model_dir)),
        config={"experiment": "exp"},
    )
    return ckpt.finalize_checkpoint(tmp, manifest)
