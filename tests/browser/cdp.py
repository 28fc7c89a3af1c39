"""A minimal Chrome DevTools Protocol client over `--remote-debugging-pipe` (no websocket, no extra package).

Chromium reads NUL-terminated JSON messages on fd 3 and writes its own on fd 4. We collect every event, so a test can
ask afterwards which requests the page made and which JavaScript errors it raised.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


def find_chromium() -> str | None:
    """Path of Debian's chromium (or another Chrome) on PATH, else None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if found := shutil.which(name):
            return found
    return None


class Browser:
    """One headless chromium with one page; events are kept in `events`."""

    def __init__(self, binary: str, width: int = 1400, height: int = 1000):
        self._profile = tempfile.mkdtemp(prefix="rlpipe-chromium-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def wire_fds() -> None:  # in the child: its fd 3 reads our messages, its fd 4 carries its answers
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)

        args = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
                "--remote-debugging-pipe", f"--user-data-dir={self._profile}", f"--window-size={width},{height}",
                "about:blank"]  # fmt: skip
        self.proc = subprocess.Popen(
            args, preexec_fn=wire_fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        self.session = self._attach(width, height)

    def _attach(self, width: int, height: int) -> str:
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.call(f"{domain}.enable", session=session)
        self.call("Emulation.setDeviceMetricsOverride", session=session, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)  # fmt: skip
        return session

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, session: str | None = None, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        """Send one command and wait for its answer (events seen meanwhile go to `events`)."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def page(self, method: str, **params: Any) -> dict[str, Any]:
        """A command on the page's session."""
        return self.call(method, session=self.session, **params)

    def wait_event(self, method: str, timeout: float = 30.0) -> dict[str, Any]:
        """Wait for the next event `method` (or return one already seen)."""
        for i, ev in enumerate(self.events):
            if ev.get("method") == method:
                return self.events.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            msg = self._read_message(deadline)
            if msg.get("method") == method:
                return msg
            self.events.append(msg)

    def open(self, path: Path) -> None:
        """Navigate to a local file and wait for its load event."""
        self.page("Page.navigate", url=path.resolve().as_uri())
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        """Run JavaScript in the page; its (JSON-able) value."""
        res = self.page("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def screenshot(self, out: Path) -> Path:
        """A PNG of the whole page (beyond the viewport)."""
        data = self.page("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        out.write_bytes(base64.b64decode(data))
        return out

    def js_errors(self) -> list[str]:
        """Uncaught exceptions and console.error calls seen so far."""
        out = []
        for ev in self.events:
            if ev.get("method") == "Runtime.exceptionThrown":
                out.append(json.dumps(ev["params"]["exceptionDetails"])[:500])
            elif ev.get("method") == "Runtime.consoleAPICalled" and ev["params"]["type"] == "error":
                out.append(json.dumps(ev["params"]["args"])[:500])
        return out

    def requests(self) -> list[str]:
        """URLs of every request the page made (file:// and data: included)."""
        return [ev["params"]["request"]["url"] for ev in self.events if ev.get("method") == "Network.requestWillBeSent"]

    def close(self) -> None:
        """Stop chromium (this process only) and remove its profile."""
        try:
            self.call("Browser.close", timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)
        shutil.rmtree(self._profile, ignore_errors=True)
