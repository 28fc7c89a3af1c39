"""Engine-side checksum evidence (issue 33): which engine parameters must move after a load, against hand-made cases."""

from __future__ import annotations

import hashlib

import pytest
import torch

from rlpipe.errors import WeightSyncError
from rlpipe.rollout.serving_dir import write_serving_dir
from rlpipe.rollout.weight_evidence import (
    EMPTY_DIGEST,
    check_checksums_moved,
    engine_param_name,
    published_digests,
)

P = "dp0:pp0:pcp0:tp0:"


def test_hf_names_map_to_vllm_fused_parameters():
    assert engine_param_name("model.layers.3.self_attn.k_proj.weight") == "model.layers.3.self_attn.qkv_proj.weight"
    assert engine_param_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj.weight"
    assert engine_param_name("lm_head.weight") == "lm_head.weight"


def _engine(**digests):
    return {P + k.replace("__", "."): v for k, v in digests.items()}


def test_exactly_the_updated_parameters_must_move():
    before = _engine(qkv_proj="a", head="h", norm="n", o="", emb="e")
    before[P + "o"] = EMPTY_DIGEST
    after = {**before, P + "qkv_proj": "a2", P + "head": "h2"}
    # q_proj changed, k_proj not: the fused qkv must move; the head moved; norm unchanged and did not move
    counts = check_checksums_moved(before, after, {"q_proj", "head"}, {"k_proj", "norm"}, "e1", 4)
    assert counts == {"engine/checksum_params_moved": 2.0, "engine/checksum_params_stuck": 0.0,
                      "engine/checksum_params_unmapped": 0.0, "engine/checksum_params_unobservable": 0.0}  # fmt: skip
    with pytest.raises(WeightSyncError, match=r"e1 after loading version 4: .*1 of 2 updated .*: head\b"):
        check_checksums_moved(before, {**before, P + "qkv_proj": "a2"}, {"q_proj", "head"}, set(), "e1", 4)
    with pytest.raises(WeightSyncError, match=r"changed that the update did not change: norm"):
        check_checksums_moved(before, {**after, P + "norm": "n2"}, {"q_proj", "head"}, {"norm"}, "e1", 4)
    # an empty (packed-elsewhere) parameter is unobservable; a name the engine lacks (shared tied head) unmapped
    counts = check_checksums_moved(before, after, {"o", "head", "lm_tied"}, set(), "e1", 4)
    assert counts["engine/checksum_params_unobservable"] == 1 and counts["engine/checksum_params_unmapped"] == 1
    # not strict (bf16 engine of fp32 weights): one stuck tensor is a metric, all stuck is still an error
    counts = check_checksums_moved(before, {**before, P + "qkv_proj": "a2"}, {"q_proj", "head"}, set(), "e", 1, False)
    assert counts["engine/checksum_params_stuck"] == 1
    with pytest.raises(WeightSyncError, match="2 of 2"):
        check_checksums_moved(before, before, {"q_proj", "head"}, set(), "e", 1, strict=False)


def test_published_digests_are_sha256_of_each_tensors_bytes(tmp_path):
    (tmp_path / "base").mkdir()
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out = write_serving_dir({"a": a, "b": torch.ones(2)}, tmp_path / "base", tmp_path / "s", 1)
    d = published_digests(out)
    assert d["a"] == hashlib.sha256(a.numpy().tobytes()).hexdigest()
    assert d["b"] == hashlib.sha256(torch.ones(2).numpy().tobytes()).hexdigest()
