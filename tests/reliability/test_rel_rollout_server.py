"""A misbehaving OpenAI-compatible rollout server on loopback: retried, then RolloutServerError (never a hang)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlpipe.errors import RolloutServerError
from rlpipe.rollout.engine import SamplingParams
from rlpipe.rollout.openai_engine import OpenAIRolloutEngine

pytestmark = pytest.mark.reliability

GOOD = {"choices": [{"index": 0, "finish_reason": "stop",
                     "logprobs": {"tokens": ["token_id:5", "token_id:2"], "token_logprobs": [-0.1, -0.2]}}]}  # fmt: skip


class FakeServer:
    """Answers POSTs from a script of behaviours, one per request (the last one repeats)."""

    def __init__(self, script: list[str]):
        self.script, self.requests = script, 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_POST(self):  # noqa: N802 - http.server API
                self.rfile.read(int(self.headers["Content-Length"]))
                kind = outer.script[min(outer.requests, len(outer.script) - 1)]
                outer.requests += 1
                if kind == "sleep":
                    time.sleep(0.6)
                body = {
                    "ok": json.dumps(GOOD).encode(),
                    "sleep": json.dumps(GOOD).encode(),
                    "garbage": b"{not json",
                    "list": b"[1, 2]",
                    "no_choices": b'{"choices": []}',
                    "text_tokens": json.dumps(
                        {"choices": [{"logprobs": {"tokens": ["hi"], "token_logprobs": [0.0]}}]}
                    ).encode(),
                    "500": b"overloaded",
                    "400": b"bad request",
                }[kind]
                status = int(kind) if kind.isdigit() else 200
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except BrokenPipeError:  # the client timed out and hung up
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _engine(url: str, retries: int = 2) -> OpenAIRolloutEngine:
    return OpenAIRolloutEngine(url, "m", timeout_s=0.2, max_retries=retries, backoff_s=0.0)


PARAMS = SamplingParams(n=1, max_new_tokens=4, stop_token_ids=[2])


@pytest.mark.parametrize("kind", ["sleep", "garbage", "list", "no_choices", "text_tokens", "500"])
def test_persistent_failure_is_retried_then_raised(kind):
    with FakeServer([kind]) as server:
        start = time.perf_counter()
        with pytest.raises(RolloutServerError, match="after 3 attempts") as info:
            _engine(server.url).generate([[1, 2, 3]], PARAMS)
        elapsed = time.perf_counter() - start
    assert server.requests == 3  # 1 try + 2 retries
    assert "prompt 0" in str(info.value)
    assert elapsed < 5.0  # timeouts are bounded, no hang
    if kind == "sleep":
        assert "timed out" in str(info.value).lower() or "timeout" in str(info.value).lower()


@pytest.mark.parametrize("first", ["sleep", "garbage", "500"])
def test_transient_failure_recovers_on_retry(first):
    with FakeServer([first, "ok"]) as server:
        gens = _engine(server.url).generate([[1, 2, 3]], PARAMS)
    assert server.requests == 2
    assert [g.response_ids for g in gens] == [[5, 2]] and gens[0].finish_reason == "stop"
    assert gens[0].logprobs == pytest.approx([-0.1, -0.2])


def test_client_error_is_not_retried():
    with FakeServer(["400"]) as server:
        with pytest.raises(RolloutServerError, match="HTTP 400"):
            _engine(server.url).generate([[1, 2, 3]], PARAMS)
    assert server.requests == 1


def test_nothing_listening_is_a_rollout_server_error():
    with FakeServer(["ok"]) as server:
        url = server.url
    with pytest.raises(RolloutServerError, match="after 2 attempts"):
        _engine(url, retries=1).generate([[1]], PARAMS)
