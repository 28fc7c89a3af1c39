"""How rlpipe meets Ray: the cluster it connects to, the environment of its workers, and the failures that mean a
worker or node was lost (recoverable: the Flyte layer retries them from the last checkpoint)."""

from __future__ import annotations

import os

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
    """Connect to the Ray cluster of this job (KubeRay sets RAY_ADDRESS) or start a local one."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", WORKER_ENV["RAY_AUTH_MODE"])
    ray.init(
        address=os.environ.get("RAY_ADDRESS"),
        ignore_reinit_error=True,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": dict(WORKER_ENV)},
    )


def lost_worker_errors() -> tuple[type[BaseException], ...]:
    """The `LOST_WORKER_ERRORS` this Ray version has."""
    import ray.exceptions as rex

    return tuple(getattr(rex, name) for name in LOST_WORKER_ERRORS if hasattr(rex, name))
