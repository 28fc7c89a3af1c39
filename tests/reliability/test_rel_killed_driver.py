"""Issue 30: a `kill -9` of the `rlpipe run` driver leaves no Ray process of that run behind.

The run's processes are found by a marker in their environment (every Ray process of a local head inherits the
driver's environment), so the test sees exactly that run's raylet, GCS, agents and workers, and nobody else's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .conftest import fast_overrides

pytestmark = pytest.mark.reliability

REPO = Path(__file__).resolve().parents[2]
MARKER = "RLPIPE_TEST_RUN_MARKER"


def _marked(token: str) -> dict[int, str]:
    """pid -> command line of every live, non-zombie process whose environment carries the marker."""
    found = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            env = Path(f"/proc/{d}/environ").read_bytes()
            state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"{MARKER}={token}".encode() in env.split(b"\0") and state != "Z":
            found[int(d)] = cmd
    return found


def _wait_for(condition, timeout_s: float, every_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    return condition()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_kill_9_of_the_driver_leaves_no_ray_process(shared_out, tmp_path):
    token = uuid.uuid4().hex
    ov = fast_overrides(
        shared_out, **{"checkpoint.root": str(tmp_path / "ckpt"), "experiment": f"kill-{token[:8]}", "iterations": 400}
    )
    argv = [sys.executable, "-m", "rlpipe.cli", "run", "--metrics", str(tmp_path / "m.jsonl")]
    argv += [a for k, v in ov.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, MARKER: token, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
    driver = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: dict[int, str] = {}
    try:
        ray_up = lambda: sum("raylet" in c or "gcs_server" in c for c in _marked(token).values()) >= 2  # noqa: E731
        assert _wait_for(ray_up, 60), "the run's local Ray never came up"
        _wait_for(lambda: (tmp_path / "m.jsonl").exists(), 30)  # workers started and trained one iteration
        seen = {p: c for p, c in _marked(token).items() if p != driver.pid}
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        left = _wait_for(lambda: not _marked(token), 15) or _marked(token)
        assert left is True, "still running after the driver was killed: " + "; ".join(
            f"{p}: {c[:100]}" for p, c in _marked(token).items()
        )
        assert any("raylet" in c for c in seen.values())
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in _marked(token):  # only this run's processes (old code leaves them): never leak from the test
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
