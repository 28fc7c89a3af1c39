"""Server adapters without a real server: what vLLM/SGLang/NCCL sync calls send, in which order, and how failures
surface. A loopback http.server records requests; a fake communicator records broadcasts."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlpipe.errors import ConfigError, RolloutServerError, WeightSyncError
from rlpipe.rollout.nccl_transfer import NCCLWeightSender, TensorMeta, init_info, iter_buckets, plan_buckets
from rlpipe.rollout.sglang_engine import SGLangEngine
from rlpipe.rollout.vllm_engine import VLLMEngine
from rlpipe.rollout.vllm_process import VLLMServer, VLLMServerSpec, check_cpu_head_dim


class Recorder:
    """Answers {} to everything unless `answers[path]` says otherwise; `fail` paths get HTTP 500."""

    def __init__(self):
        self.requests: list[tuple[str, dict]] = []
        self.answers: dict[str, dict] = {}
        self.fail: set[str] = set()
        self.events: list[str] = []  # shared with the fake communicator to check interleaving
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._reply(None)

            def do_POST(self):
                self._reply(json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}"))

            def _reply(self, body):
                route = self.path.split("?")[0]
                outer.requests.append((self.path, body))
                outer.events.append(f"http {route}")
                code, payload = (500, {"error": "boom"}) if route in outer.fail else (200, outer.answers.get(route, {}))
                raw = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]


@pytest.fixture
def server():
    rec = Recorder()
    yield rec
    rec.httpd.shutdown()


def test_vllm_load_is_pause_reload_reset_tag_resume_then_reads_back_the_evidence(server):
    server.answers["/weight_checker"] = {"checksums": {"dp0:pp0:pcp0:tp0:model.norm.weight": "aa"}}
    server.answers["/weight_info"] = {"weight_version": "3"}
    engine = VLLMEngine(server.url, "policy", eos_token_id=2)
    engine.load_weights("/w/v00000003", 3)
    assert server.paths() == ["/weight_checker", "/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache",
                              "/update_weight_version", "/resume", "/weight_info", "/weight_checker"]  # fmt: skip
    assert server.requests[0][1] == {"action": "checksum"}
    assert server.requests[2][1] == {"method": "reload_weights", "kwargs": {"weights_path": "/w/v00000003"}}
    assert server.requests[4][1] == {"new_version": "3"}
    assert engine.served_version == 3 and engine.served_dir == "/w/v00000003"
    server.requests.clear()
    server.answers["/weight_info"] = {"weight_version": "4"}
    engine.load_weights("/w/v00000004", 4)
    assert server.paths()[0] == "/pause?mode=wait"  # the checksums read after the last load are the next "before"


def test_vllm_load_fails_when_the_engine_reports_another_version(server):
    server.answers["/weight_checker"] = {"checksums": {}}
    server.answers["/weight_info"] = {"weight_version": "2"}
    engine = VLLMEngine(server.url, "policy", eos_token_id=2)
    with pytest.raises(WeightSyncError, match="reports weight version '2' after loading version 3"):
        engine.load_weights("/w/v3", 3)
    assert engine.served_version is None  # unverified: the caller must not trust it


def test_vllm_failed_reload_still_resumes_and_keeps_no_verified_version(server):
    server.answers["/weight_checker"] = {"checksums": {}}
    engine = VLLMEngine(server.url, "policy", eos_token_id=2)
    engine.served_version = 2
    server.fail.add("/collective_rpc")
    with pytest.raises(RolloutServerError, match="collective_rpc: HTTP 500"):
        engine.load_weights("/w/v3", 3)
    assert server.paths()[-1] == "/resume" and engine.served_version is None


def test_vllm_score_reads_prompt_logprobs_of_the_response_positions(server):
    entries = [None, {"5": {"logprob": -0.1}}, {"token_id:7": {"logprob": -0.2}}, {"9": {"logprob": -0.3}}]
    server.answers["/v1/completions"] = {"choices": [{"prompt_logprobs": entries}]}
    engine = VLLMEngine(server.url, "policy", eos_token_id=2)
    assert engine.score([1, 5], [7, 9]) == [-0.2, -0.3]
    body = server.requests[0][1]
    assert body["prompt"] == [1, 5, 7, 9] and body["prompt_logprobs"] == 0 and body["max_tokens"] == 1
    server.answers["/v1/completions"] = {"choices": [{"prompt_logprobs": entries[:3]}]}
    with pytest.raises(RolloutServerError, match="malformed prompt_logprobs"):
        engine.score([1, 5], [7, 9])


def test_sglang_load_and_score(server):
    engine = SGLangEngine(server.url + "/v1", "policy", eos_token_id=2)
    server.answers["/update_weights_from_disk"] = {"success": True, "message": "ok"}
    engine.load_weights("/w/v4", 4)
    assert server.paths() == ["/update_weights_from_disk", "/flush_cache"]
    assert server.requests[0][1] == {"model_path": "/w/v4", "load_format": "auto", "weight_version": "4"}
    server.answers["/update_weights_from_disk"] = {"success": False, "message": "shape mismatch"}
    with pytest.raises(RolloutServerError, match="shape mismatch"):
        engine.load_weights("/w/v5", 5)
    assert engine.served_version == 4
    server.answers["/generate"] = {"meta_info": {"input_token_logprobs": [[None, 1, ""], [-0.5, 5, ""], [-0.7, 6, ""]]}}
    assert engine.score([1], [5, 6]) == [-0.5, -0.7]
    assert server.requests[-1][1]["input_ids"] == [1, 5, 6] and server.requests[-1][1]["logprob_start_len"] == 0
    with pytest.raises(RolloutServerError, match="expected 7"):
        engine.score([1], [7, 6])


def test_buckets_keep_order_and_bound_size():
    metas = [TensorMeta(f"w{i}", "float32", (n,), 4 * n) for i, n in enumerate([10, 10, 30, 5, 1])]
    buckets = plan_buckets(metas, bucket_bytes=80)
    assert [[m.name for m in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4"]]  # w2 (120 B) goes alone
    assert [m for b in buckets for m in b] == metas
    with pytest.raises(ConfigError):
        plan_buckets(metas, 0)


def test_buckets_materialise_lazily_in_order():
    seen: list[str] = []
    pairs = [(f"p{i}", torch.full((4,), float(i))) for i in range(3)]

    def materialize(t):
        seen.append(f"gather {int(t[0])}")
        return t * 1

    it = iter_buckets(pairs, bucket_bytes=16, materialize=materialize)
    first = next(it)
    assert [n for n, _ in first] == ["p0"] and seen == ["gather 0"]  # nothing else gathered yet
    rest = list(it)
    assert [n for b in rest for n, _ in b] == ["p1", "p2"] and seen == ["gather 0", "gather 1", "gather 2"]


class FakeBroadcaster:
    def __init__(self, events):
        self.events, self.sent = events, []

    def broadcast(self, tensor, src=0):
        assert src == 0 and tensor.is_contiguous()
        self.sent.append(tensor.clone())
        self.events.append(f"broadcast {tuple(tensor.shape)}")


def test_nccl_sender_announces_each_bucket_then_broadcasts_it(server):
    comm = FakeBroadcaster(server.events)
    sender = NCCLWeightSender(server.url, comm)
    w = torch.arange(6.0).reshape(2, 3).t()  # non-contiguous: must be sent contiguous
    buckets = [[("a", torch.ones(2)), ("b", w)], [("c", torch.zeros(1, dtype=torch.bfloat16))]]
    assert sender.send(iter(buckets), version=9) == 3
    routes = [p for p, _ in server.requests]
    assert routes[:2] == ["/pause?mode=wait", "/start_weight_update"]
    assert routes[-3:] == ["/finish_weight_update", "/reset_prefix_cache", "/resume"]
    updates = [b for p, b in server.requests if p == "/update_weights"]
    assert updates == [
        {"update_info": {"names": ["a", "b"], "dtype_names": ["float32", "float32"], "shapes": [[2], [3, 2]]}},
        {"update_info": {"names": ["c"], "dtype_names": ["bfloat16"], "shapes": [[1]]}},
    ]
    assert server.requests[-3][1] == {"weight_version": "9"}
    assert torch.equal(comm.sent[1], w) and len(comm.sent) == 3
    assert init_info("10.0.0.1", 29500, 2) == {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
                                              "world_size": 3, "packed": False}  # fmt: skip


def test_nccl_sender_resumes_the_server_when_an_update_is_rejected(server):
    server.fail.add("/update_weights")
    sender = NCCLWeightSender(server.url, FakeBroadcaster(server.events), timeout_s=5)
    with pytest.raises(RolloutServerError, match="update_weights: HTTP 500"):
        sender.send(iter([[("a", torch.ones(2))]]), version=1)
    assert server.paths()[-1] == "/resume" and "/finish_weight_update" not in server.paths()


def _fake_python(tmp_path, body: str) -> str:
    """An executable standing in for the vLLM venv's python: ignores the vLLM arguments, runs `body`."""
    script = tmp_path / "fake_server.py"
    script.write_text(body)
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    exe.chmod(0o755)
    return str(exe)


HEALTH_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
print("fake vllm up", flush=True)
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_managed_server_starts_healthy_logs_and_stops(tmp_path):
    spec = VLLMServerSpec(python=_fake_python(tmp_path, HEALTH_SERVER), model_dir=str(tmp_path), served_model_name="p",
                          log_path=str(tmp_path / "logs" / "vllm.log"), startup_timeout_s=30)  # fmt: skip
    server = VLLMServer(spec, log=lambda m: None)
    server.start()
    try:
        assert server.alive() and server.healthy()
        assert "--logprobs-mode processed_logprobs" in " ".join(spec.command(server.port))
    finally:
        server.stop()
    assert not server.alive()
    log = (tmp_path / "logs" / "vllm.log").read_text()
    assert "rlpipe: start 1" in log and "fake vllm up" in log


def test_managed_server_that_dies_at_start_quotes_its_log(tmp_path):
    spec = VLLMServerSpec(python=_fake_python(tmp_path, "import sys; print('CUDA out of memory'); sys.exit(3)"),
                          model_dir=str(tmp_path), served_model_name="p", log_path=str(tmp_path / "v.log"))  # fmt: skip
    with pytest.raises(RolloutServerError, match=r"(?s)exited during start-up \(code 3\).*CUDA out of memory"):
        VLLMServer(spec, log=lambda m: None).start()


def test_cpu_head_dim_check_names_the_fix(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(ConfigError, match=r"head_dim 16.*model.tiny.num_heads"):
        check_cpu_head_dim(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 2}))
    check_cpu_head_dim(str(tmp_path))


def test_a_managed_cpu_server_never_splits_a_prompt_and_the_users_args_win(tmp_path):
    """Seeded requests + chunked prefill kill vLLM's CPU engine (see `cpu_server_args`): rlpipe's CPU server runs
    without chunked prefill, with a step budget that holds the longest prompt; on GPU nothing is added."""
    from rlpipe.config import load_config
    from rlpipe.rollout.sources import managed_server_spec

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 2}))
    cfg = load_config(overrides={"rollout.engine": "vllm", "rollout.vllm.python": sys.executable,
                                 "rollout.vllm.max_model_len": 10000, "output_dir": str(tmp_path),
                                 "rollout.vllm.extra_args": ["--max-num-batched-tokens", "20000"]})  # fmt: skip
    command = managed_server_spec(cfg, str(tmp_path), "policy", on_gpu=False).command(8000)
    assert "--no-enable-chunked-prefill" in command
    budgets = [int(command[i + 1]) for i, arg in enumerate(command) if arg == "--max-num-batched-tokens"]
    assert budgets == [10000, 20000]  # at least max_model_len; the user's, later on the line, is what vLLM keeps
    gpu = managed_server_spec(cfg, str(tmp_path), "policy", on_gpu=True).command(8000)
    assert "--no-enable-chunked-prefill" not in gpu and gpu.count("--max-num-batched-tokens") == 1
