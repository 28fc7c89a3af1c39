"""OpenAI-compatible engine against a fake /v1/completions server on loopback (http.server in a thread)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlpipe.errors import ConfigError, RolloutServerError
from rlpipe.rollout.engine import RolloutEngine, SamplingParams
from rlpipe.rollout.openai_engine import OpenAIRolloutEngine

EOS = 2


class FakeServer:
    """Answers per a ``mode`` the test sets; records every request body."""

    def __init__(self):
        self.mode = "ok"
        self.requests: list[dict] = []
        self.calls = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.calls += 1
                    call = outer.calls
                    outer.requests.append({"path": self.path, "body": body})
                mode = outer.mode
                if mode == "slow_first" and call == 1:
                    time.sleep(0.6)  # longer than the client timeout
                if mode == "malformed":
                    return self._send(200, b"{not json")
                if mode == "500_then_ok" and call == 1:
                    return self._send(500, b'{"error": "boom"}')
                if mode == "400":
                    return self._send(400, b'{"error": "bad prompt"}')
                if mode == "text_tokens":
                    choice = {"index": 0, "logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]}}
                    return self._send(200, json.dumps({"choices": [choice]}).encode())
                self._send(200, json.dumps(outer.answer(body)).encode())

            def _send(self, code, payload):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                try:
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    @staticmethod
    def answer(body):
        """Deterministic vLLM-like choices: sample s of prompt p -> tokens [p0+s, p0+s+1, EOS, 9] (reversed order)."""
        p0 = body["prompt"][0]
        choices = []
        for s in range(body["n"]):
            toks = [p0 + s + 10, p0 + s + 11, EOS, 9][: body["max_tokens"]]
            if s == 1:
                toks = [t for t in toks if t != EOS]  # no stop token: "length"
            choices.append(
                {
                    "index": s,
                    "text": "ignored",
                    "finish_reason": "stop" if EOS in toks else "length",
                    "logprobs": {
                        "tokens": [f"token_id:{t}" for t in toks],
                        "token_logprobs": [-0.1 * (i + 1) for i in range(len(toks))],
                        "top_logprobs": None,
                    },
                }
            )
        return {"id": "cmpl-1", "object": "text_completion", "choices": list(reversed(choices))}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def _engine(server, **kw):
    kw.setdefault("timeout_s", 5)
    kw.setdefault("backoff_s", 0.01)
    return OpenAIRolloutEngine(server.url, "policy", eos_token_id=EOS, **kw)


def test_normal_answer(server):
    eng = _engine(server)
    assert isinstance(eng, RolloutEngine)
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=4, stop_token_ids=[7], seed=3)
    gens = eng.generate([[100, 1, 2], [200, 5]], params)
    assert [(g.prompt_index, g.sample_index) for g in gens] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    g00, g01, g10 = gens[0], gens[1], gens[2]
    assert g00.response_ids == [110, 111, EOS] and g00.finish_reason == "stop"  # truncated after EOS
    assert g00.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert g01.response_ids == [111, 112, 9] and g01.finish_reason == "length"
    assert g10.response_ids == [210, 211, EOS]
    assert len(server.requests) == 2
    req = sorted(server.requests, key=lambda r: r["body"]["prompt"][0])[0]
    assert req["path"] == "/v1/completions"
    b = req["body"]
    assert b["prompt"] == [100, 1, 2] and b["model"] == "policy" and b["n"] == 2 and b["max_tokens"] == 4
    assert (b["temperature"], b["top_p"], b["top_k"]) == (0.7, 0.9, 5)
    seeds = {r["body"]["prompt"][0]: r["body"]["seed"] for r in server.requests}
    assert seeds == {100: 3 * 1_000_003, 200: 3 * 1_000_003 + 1}  # one seed per prompt: uncorrelated samples
    assert b["return_tokens_as_token_ids"] is True and b["logprobs"] >= 0 and b["stop_token_ids"] == [7]


def test_base_url_with_v1_and_extra_body(server):
    eng = OpenAIRolloutEngine(server.url + "/v1/", "m", extra_body={"min_p": 0.0}, backoff_s=0.01)
    eng.generate([[1]], SamplingParams(n=1, max_new_tokens=2))
    assert server.requests[0]["path"] == "/v1/completions"
    assert server.requests[0]["body"]["min_p"] == 0.0
    assert "top_k" not in server.requests[0]["body"]  # top_k=0 means off: not sent


def test_timeout_then_success(server):
    server.mode = "slow_first"
    eng = _engine(server, timeout_s=0.2, max_retries=2)
    gens = eng.generate([[100]], SamplingParams(n=1, max_new_tokens=4))
    assert gens[0].response_ids == [110, 111, EOS]
    assert server.calls == 2


def test_5xx_then_success(server):
    server.mode = "500_then_ok"
    gens = _engine(server).generate([[100]], SamplingParams(n=1, max_new_tokens=4))
    assert gens[0].finish_reason == "stop" and server.calls == 2


def test_malformed_json_every_time(server):
    server.mode = "malformed"
    eng = _engine(server, max_retries=3)
    with pytest.raises(RolloutServerError, match=r"after 4 attempts.*malformed JSON"):
        eng.generate([[100]], SamplingParams(n=1))
    assert server.calls == 4


def test_client_error_is_not_retried(server):
    server.mode = "400"
    with pytest.raises(RolloutServerError, match="HTTP 400"):
        _engine(server).generate([[1]], SamplingParams(n=1))
    assert server.calls == 1


def test_text_tokens_are_rejected(server):
    server.mode = "text_tokens"
    with pytest.raises(RolloutServerError, match="return_tokens_as_token_ids"):
        _engine(server, max_retries=0).generate([[1]], SamplingParams(n=1))


def test_connection_refused():
    s = FakeServer()
    url = s.url
    s.close()
    eng = OpenAIRolloutEngine(url, "m", max_retries=1, backoff_s=0.01, timeout_s=1)
    with pytest.raises(RolloutServerError, match="after 2 attempts"):
        eng.generate([[1]], SamplingParams(n=1))


def test_bad_config():
    with pytest.raises(ConfigError):
        OpenAIRolloutEngine("localhost:8000", "m")
    with pytest.raises(ConfigError):
        OpenAIRolloutEngine("http://x", "m", max_retries=-1)
    with pytest.raises(ConfigError):
        OpenAIRolloutEngine("http://x", "m").generate([[]], SamplingParams(n=1))
