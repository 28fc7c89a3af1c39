"""The weight-sync contract: serving directories, the probe, and EngineSync's lazy, verified syncs and restarts."""

from __future__ import annotations

import math

import pytest
import torch

from rlpipe.errors import RolloutServerError, WeightSyncError
from rlpipe.models.tiny import TinyModelConfig, build_tiny_model
from rlpipe.rollout.engine import Generation, SamplingParams
from rlpipe.rollout.engine_sync import EngineSync
from rlpipe.rollout.probe import ProbeSequence, build_probe, check_probe, compare_probe
from rlpipe.rollout.serving_dir import (
    VERSION_FILE,
    WEIGHTS_FILE,
    serving_dir_version,
    serving_state_dict,
    write_serving_dir,
)


def _tiny():
    return build_tiny_model(TinyModelConfig(), vocab_size=40, seed=3, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, written out from the logits (independent of rlpipe's packed forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return torch.stack([logp[t - 1, ids[t]] for t in range(1, len(ids))])


def test_serving_dir_of_tied_model_loads_to_the_same_logprobs(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _tiny()
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(0.3)  # moves the tied head too: a stale head would show
    model.config.save_pretrained(tmp_path / "base")
    state = serving_state_dict(model.state_dict(), "model.embed_tokens.weight", "lm_head.weight")
    assert (
        "lm_head.weight" in state
        and state["lm_head.weight"].data_ptr() != state["model.embed_tokens.weight"].data_ptr()
    )
    out = write_serving_dir(state, tmp_path / "base", tmp_path / "serving", version=7)
    assert out.name == "v00000007" and serving_dir_version(out) == 7
    assert {p.name for p in out.iterdir()} >= {"config.json", WEIGHTS_FILE, VERSION_FILE}
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = [1, 5, 9, 12, 30, 4]
    assert torch.allclose(_hf_logprobs(loaded, ids), _hf_logprobs(model, ids), atol=1e-6)


def test_serving_dirs_keep_the_newest_and_never_leave_half_written_ones(tmp_path, monkeypatch):
    model = _tiny()
    model.config.save_pretrained(tmp_path / "base")
    state = serving_state_dict(model.state_dict(), "model.embed_tokens.weight", "lm_head.weight")
    for v in (1, 2, 3):
        write_serving_dir(state, tmp_path / "base", tmp_path / "s", v, keep=2)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["v00000002", "v00000003"]

    import safetensors.torch

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        write_serving_dir(state, tmp_path / "base", tmp_path / "s", 4)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["v00000002", "v00000003"]  # no v4, no temp dir


def test_probe_is_deterministic_and_avoids_special_ids():
    a = build_probe([[5, 6], [7]], vocab_size=50, num_sequences=3, response_length=8, seed=1)
    b = build_probe([[5, 6], [7]], vocab_size=50, num_sequences=3, response_length=8, seed=1)
    assert a == b and [p.prompt_ids for p in a] == [[5, 6], [7], [5, 6]]
    assert all(3 <= t < 50 and len(p.response_ids) == 8 for p in a for t in p.response_ids)
    with pytest.raises(WeightSyncError):
        build_probe([], 50, 2, 4)


def test_probe_comparison_catches_differences_and_nan():
    ok = compare_probe([[-1.0, -2.0]], [[-1.0005, -2.0]])
    assert math.isclose(ok.max_abs_diff, 5e-4, rel_tol=1e-6) and ok.tokens == 2
    check_probe(ok, 1e-3, "vllm x", 3)
    with pytest.raises(WeightSyncError, match=r"vllm x .*version 3.*0\.5"):
        check_probe(compare_probe([[-1.5, -2.0]], [[-1.0, -2.0]]), 1e-3, "vllm x", 3)
    with pytest.raises(WeightSyncError):
        check_probe(compare_probe([[float("nan")]], [[-1.0]]), 1e-3, "e", 1)
    with pytest.raises(WeightSyncError, match="sequence 0"):
        compare_probe([[-1.0]], [[-1.0, -2.0]])


def test_the_probe_is_one_batched_request_where_the_engine_batches_else_one_per_sequence():
    from rlpipe.rollout.probe import score_probe

    probe = [ProbeSequence([1, 2], [3]), ProbeSequence([4], [5, 6])]

    class OneByOne:
        def __init__(self):
            self.calls = []

        def score(self, prompt_ids, response_ids):
            self.calls.append((prompt_ids, response_ids))
            return [-float(t) for t in response_ids]

    class Batching(OneByOne):
        def score_many(self, pairs):
            self.calls.append(("many", pairs))
            return [[-float(t) for t in r] for _, r in pairs]

    single, batched = OneByOne(), Batching()
    assert score_probe(single, probe) == score_probe(batched, probe) == [[-3.0], [-5.0, -6.0]]
    assert single.calls == [([1, 2], [3]), ([4], [5, 6])]
    assert batched.calls == [("many", [([1, 2], [3]), ([4], [5, 6])])]


class FakeEngine:
    """Serves `weights` (a float per version); scores the probe as -weight; can die."""

    name = "fake http://x"
    restartable = True

    def __init__(self, drop_loads: bool = False):
        self.served_version = None
        self.served_dir = None
        self.weight = None
        self.loads: list[int] = []
        self.dead = False
        self.restarts = 0
        self.drop_loads = drop_loads  # a partial sync: the load "succeeds" but nothing changes

    def load_weights(self, serving_dir, version):
        self.loads.append(version)
        if not self.drop_loads or self.weight is None:
            self.weight = float(serving_dir)
        self.served_version, self.served_dir = version, serving_dir

    def score(self, prompt_ids, response_ids):
        return [-self.weight] * len(response_ids)

    def generate(self, prompts, params):
        if self.dead:
            raise RolloutServerError("connection refused")
        return [Generation(i, 0, [3], [-self.weight], "stop") for i in range(len(prompts))]

    def alive(self):
        return not self.dead

    def restart(self):
        self.dead, self.restarts, self.served_version = False, self.restarts + 1, None

    def close(self):
        pass


def _sync(engine, published, trainer_calls, max_restarts=2, publish_ahead=False):
    from rlpipe.rollout.probe import ProbeSequence

    def publish(version):
        published.append(version)
        return str(version * 0.5)  # the "weights" of version v are 0.5 v

    def trainer_probe(seqs):
        trainer_calls.append(len(seqs))
        return [[-0.5 * published[-1]] * len(s.response_ids) for s in seqs]  # what the trainer holds now

    probe = [ProbeSequence([1, 2], [3, 4])]
    return EngineSync(engine, publish, trainer_probe, probe, 1e-3, max_restarts=max_restarts, log=lambda m: None,
                      publish_ahead=publish_ahead)  # fmt: skip


def test_syncs_are_lazy_verified_and_counted():
    engine, published, calls = FakeEngine(), [], []
    sync = _sync(engine, published, calls)
    params = SamplingParams(n=1)
    sync.generate([[1]], params, version=0)
    assert published == [0] and engine.served_version == 0 and sync.stats.syncs == 1
    sync.generate([[1]], params, version=0)  # nothing changed: no sync
    assert published == [0] and sync.stats.syncs == 0
    sync.generate([[1]], params, version=1)
    assert published == [0, 1] and engine.loads == [0, 1] and calls == [1, 1]


def test_a_partial_sync_is_an_error_naming_engine_version_and_difference():
    engine, published, calls = FakeEngine(drop_loads=True), [], []
    sync = _sync(engine, published, calls)
    sync.generate([[1]], SamplingParams(n=1), version=0)
    with pytest.raises(WeightSyncError, match=r"fake http://x .*version 1: max \|logprob difference\| .* 0\.5"):
        sync.generate([[1]], SamplingParams(n=1), version=1)
    assert engine.served_version is None  # never trusted again without a new, verified load


def test_a_staged_publish_leaves_the_served_weights_alone_until_the_next_sync_loads_it():
    engine, published, calls = FakeEngine(), [], []
    sync = _sync(engine, published, calls, publish_ahead=True)
    sync.ensure_current(0)
    sync.stage(1)  # while a producer would still sample version 0
    assert published == [0, 1] and engine.loads == [0] and engine.served_version == 0
    gens, restarts = sync.generate_served([[1]], SamplingParams(n=1), 0)
    assert restarts == 0 and gens[0].logprobs == [-0.0]
    # a crash now restarts from version 0's directory and is verified against version 0's probe, not the staged one
    engine.dead = True
    _, restarts = sync.generate_served([[1]], SamplingParams(n=1), 0)
    assert restarts == 1 and engine.served_version == 0
    sync.stats = type(sync.stats)()
    sync.ensure_current(1)  # loads what was staged: no second publish, no second trainer probe
    assert published == [0, 1] and engine.loads == [0, 1] and calls == [1, 1] and engine.weight == 0.5
    row = sync.stats.row(1)
    assert row["engine/staged_publish_time_s"] == row["engine/publish_time_s"] > 0
    assert row["engine/sync_blocking_time_s"] == pytest.approx(row["engine/sync_time_s"] - row["engine/publish_time_s"])


def test_a_stale_stage_is_dropped_and_a_streamed_publisher_never_stages():
    engine, published, calls = FakeEngine(), [], []
    sync = _sync(engine, published, calls, publish_ahead=True)
    sync.ensure_current(0)
    sync.stage(1)
    sync.ensure_current(2)  # not the staged version: published afresh
    assert published == [0, 1, 2] and engine.loads == [0, 2] and engine.weight == 1.0
    streamed, published2 = FakeEngine(), []
    sync = _sync(streamed, published2, [], publish_ahead=False)
    sync.ensure_current(0)
    sync.stage(1)  # an NCCL-like publisher changes the served weights: it must wait for the lock
    assert published2 == [0] and streamed.served_version == 0


def test_a_dead_managed_engine_is_restarted_resynced_and_bounded():
    engine, published, calls = FakeEngine(), [], []
    sync = _sync(engine, published, calls, max_restarts=1)
    sync.generate([[1]], SamplingParams(n=1), version=0)
    engine.dead = True
    gens = sync.generate([[1]], SamplingParams(n=1), version=0)
    assert len(gens) == 1 and engine.restarts == 1 and sync.stats.restarts == 1 and engine.loads == [0, 0]
    engine.dead = True
    with pytest.raises(RolloutServerError, match="after 1 restarts"):
        sync.generate([[1]], SamplingParams(n=1), version=0)


def test_a_live_engine_that_errs_is_not_restarted():
    engine, published, calls = FakeEngine(), [], []
    sync = _sync(engine, published, calls)
    engine.generate = lambda prompts, params: (_ for _ in ()).throw(RolloutServerError("HTTP 400"))
    with pytest.raises(RolloutServerError, match="HTTP 400"):
        sync.generate([[1]], SamplingParams(n=1), version=0)
    assert engine.restarts == 0
