"""A JSON-over-HTTP call with a clear error: the admin routes of inference servers (weight loads, cache resets)."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any

from rlpipe.errors import RolloutServerError


def request_json(url: str, body: dict[str, Any] | None = None, timeout_s: float = 120.0, method: str = "POST") -> Any:
    """POST (or GET when `body` is None and method is GET) `body` as JSON; the decoded answer, {} when empty.

    Any transport failure or non-2xx status raises `RolloutServerError` naming the URL and quoting the answer.
    """
    raw = request_raw(url, body, timeout_s, method)
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RolloutServerError(f"{method} {url}: malformed JSON answer: {raw[:200]!r}") from e


def request_raw(url: str, body: dict[str, Any] | None = None, timeout_s: float = 120.0, method: str = "POST") -> bytes:
    """`request_json`'s transport: the answer's bytes (routes such as vLLM's `/v1/load_lora_adapter` answer text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode(errors="replace")
        raise RolloutServerError(f"{method} {url}: HTTP {e.code}: {detail}") from e
    except (OSError, http.client.HTTPException) as e:
        raise RolloutServerError(f"{method} {url}: {type(e).__name__}: {e}") from e
    return raw
