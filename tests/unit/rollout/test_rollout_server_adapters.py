"""Server adapters without a real server: what vLLM/SGLang sync calls send, in which order, and how failures
surface. A loopback http.server records requests (`tests.fake_http.Recorder`); the NCCL transfer is tested in
test_nccl_transfer.py."""

from __future__ import annotations

import json
import sys

import pytest

from rlpipe.errors import ConfigError, RolloutServerError, WeightSyncError
from rlpipe.rollout.sglang_engine import SGLangEngine
from rlpipe.rollout.vllm_engine import VLLMEngine
from rlpipe.rollout.vllm_process import VLLMServer, VLLMServerSpec, check_cpu_head_dim
from tests.fake_http import Recorder


@pytest.fixture
def server():
    rec = Recorder()
    yield rec
    rec.close()


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
    server.answers["/v1/completions"] = {"choices": [{"index": 0, "prompt_logprobs": entries}]}
    engine = VLLMEngine(server.url, "policy", eos_token_id=2)
    assert engine.score([1, 5], [7, 9]) == [-0.2, -0.3]
    body = server.requests[0][1]
    assert body["prompt"] == [[1, 5, 7, 9]] and body["prompt_logprobs"] == 0 and body["max_tokens"] == 1
    server.answers["/v1/completions"] = {"choices": [{"index": 0, "prompt_logprobs": entries[:3]}]}
    with pytest.raises(RolloutServerError, match="malformed prompt_logprobs"):
        engine.score([1, 5], [7, 9])


def test_vllm_scores_a_whole_probe_in_one_request_and_matches_answers_by_index(server):
    first = [None, {"5": {"logprob": -0.1}}, {"7": {"logprob": -0.2}}]
    second = [None, {"8": {"logprob": -0.4}}, {"6": {"logprob": -0.5}}, {"4": {"logprob": -0.6}}]
    server.answers["/v1/completions"] = {"choices": [{"index": 1, "prompt_logprobs": second},
                                                     {"index": 0, "prompt_logprobs": first}]}  # fmt: skip
    engine = VLLMEngine(server.url, "policy", eos_token_id=2)
    assert engine.score_many([([1], [5, 7]), ([3, 8], [6, 4])]) == [[-0.1, -0.2], [-0.5, -0.6]]
    assert len(server.requests) == 1 and server.requests[0][1]["prompt"] == [[1, 5, 7], [3, 8, 6, 4]]
    server.answers["/v1/completions"] = {"choices": [{"index": 0, "prompt_logprobs": first}]}
    with pytest.raises(RolloutServerError, match="1 choices for 2 sequences"):
        engine.score_many([([1], [5, 7]), ([3, 8], [6, 4])])


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


def test_a_pinned_server_and_its_children_run_only_on_their_cores(tmp_path):
    import os

    core = sorted(os.sched_getaffinity(0))[-1]
    body = HEALTH_SERVER.replace(
        'print("fake vllm up", flush=True)',
        "import os, subprocess\n"
        "print('server cores', sorted(os.sched_getaffinity(0)), flush=True)\n"
        "subprocess.run([sys.executable, '-c', 'import os; print(\"child cores\", sorted(os.sched_getaffinity(0)))'])",
    )
    spec = VLLMServerSpec(python=_fake_python(tmp_path, body), model_dir=str(tmp_path), served_model_name="p",
                          log_path=str(tmp_path / "vllm.log"), startup_timeout_s=30, cpus=(core,))  # fmt: skip
    server = VLLMServer(spec, log=lambda m: None)
    server.start()
    server.stop()
    log = (tmp_path / "vllm.log").read_text()
    assert f"server cores [{core}]" in log and f"child cores [{core}]" in log
    assert spec.command(1)[:3] == ["taskset", "-c", str(core)]


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
