"""How rlpipe meets Ray: the cluster it connects to, the environment of its workers, and the failures that mean a
worker or node was lost (recoverable: the Flyte layer retries them from the last checkpoint)."""

from __future__ import annotations

import os
import subprocess
import sys

WORKER_ENV = {
    "RAY_AUTH_MODE": "disabled",  # local Ray 2.60 otherwise asks for a token
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}
"""Environment of every Ray worker process (and defaults of the driver's own)."""

LOST_WORKER_ERRORS = ("RayActorError", "ActorDiedError", "NodeDiedError", "ActorUnavailableError", "WorkerCrashedError")
"""Names of the Ray exceptions that mean an actor, worker process or node is gone."""


def set_driver_env() -> None:
    """The driver gets the workers' environment as defaults (idempotent; explicit settings win)."""
    for key, value in WORKER_ENV.items():
        if key != "TRANSFORMERS_VERBOSITY":
            os.environ.setdefault(key, value)


def ensure_ray() -> None:
    """Connect to the Ray cluster of this job (KubeRay and `ray job submit` set RAY_ADDRESS) or start a local one.

    Without RAY_ADDRESS the address is "local", not None: given None, `ray.init` attaches to the newest Ray instance
    on the machine (/tmp/ray/ray_current_cluster), so a run started beside another driver's Ray, or beside a
    `ray.cluster_utils.Cluster` in a test, would join that cluster (measured: it did, and failed when it went away).
    """
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", WORKER_ENV["RAY_AUTH_MODE"])
    local = not os.environ.get("RAY_ADDRESS")
    ray.init(
        address="local" if local else os.environ["RAY_ADDRESS"],
        ignore_reinit_error=True,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": dict(WORKER_ENV)},
    )
    if local:
        start_reaper()  # a killed driver must not leave this local Ray running


def lost_worker_errors() -> tuple[type[BaseException], ...]:
    """The `LOST_WORKER_ERRORS` this Ray version has."""
    import ray.exceptions as rex

    return tuple(getattr(rex, name) for name in LOST_WORKER_ERRORS if hasattr(rex, name))


_REAPER = r"""
import os, signal, sys, time

driver, interval, me = int(sys.argv[1]), float(sys.argv[2]), os.getpid()


def stat(pid):
    # (ppid, start time, state) of a process from /proc/<pid>/stat, or None once it is gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19]), fields[0]
    except (OSError, ValueError, IndexError):
        return None


def tree(roots):
    # roots and all their live descendants, as {pid: start time}
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (s := stat(int(d))) is not None:
            children.setdefault(s[0], []).append((int(d), s[1]))
    out, todo = {}, list(roots)
    while todo:
        for pid, start in children.get(todo.pop(), []):
            if pid != me and pid not in out:
                out[pid] = start
                todo.append(pid)
    return out


tracked = {}
while (s := stat(driver)) is not None and s[2] != "Z":
    tracked.update(tree([driver]))
    time.sleep(interval)
tracked.update(tree(list(tracked)))
for sig in (signal.SIGTERM, signal.SIGKILL):
    for pid, start in tracked.items():
        if (s := stat(pid)) is not None and s[1] == start:  # the same process, not a reused pid
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    time.sleep(2.0)
"""


def start_reaper(interval_s: float = 0.5) -> subprocess.Popen | None:
    """A watchdog that kills the processes this driver started (the local Ray head, its agents and workers, a managed
    server) once the driver is gone, even by SIGKILL.

    Why: Ray's head processes outlive a killed driver (its dashboard and runtime-env agents ignore SIGTERM), holding
    CPUs and memory. The watchdog runs in its own session (a signal to the driver's group does not reach it), tracks
    the driver's descendants while it lives, then sends SIGTERM and SIGKILL to those still alive (matched by start
    time, so a reused pid is never hit). Linux only (/proc); elsewhere it returns None.
    """
    if not os.path.isdir("/proc/self"):
        return None
    return subprocess.Popen(
        [sys.executable, "-c", _REAPER, str(os.getpid()), str(interval_s)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
