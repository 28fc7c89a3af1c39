"""A loopback HTTP server that records every request and answers from a table: the fake of a vLLM/SGLang server's
admin and OpenAI routes in the unit tests."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Recorder:
    """Answers {} to everything unless `answers[path]` says otherwise or `handlers[path](body)` computes the
    answer; `fail` paths get HTTP 500."""

    def __init__(self):
        self.requests: list[tuple[str, dict]] = []
        self.answers: dict[str, dict] = {}
        self.handlers: dict[str, Callable[[Any], Any]] = {}
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
                if route in outer.fail:
                    code, payload = 500, {"error": "boom"}
                elif route in outer.handlers:
                    code, payload = 200, outer.handlers[route](body)
                else:
                    code, payload = 200, outer.answers.get(route, {})
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

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
