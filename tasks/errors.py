"""Map failures a retry can fix to Flyte's recoverable exception, so `retries=` applies to them and only them.

Flyte retries a task on a *recoverable* user error (FlyteRecoverableException) or a system error; a plain exception
is non-recoverable and fails the run at once. A lost Ray actor or node (preempted spot node, OOM-killed worker) is
recoverable: the retry resumes from the last complete checkpoint. A bad config or data file is not: retrying would
fail the same way, so those keep failing fast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from flytekit.exceptions.user import FlyteRecoverableException

from rlpipe.errors import RecoverableError
from rlpipe.ray_env import lost_worker_errors


def recoverable_types() -> tuple[type[BaseException], ...]:
    """RecoverableError plus Ray's actor/node-loss exceptions present in the installed Ray."""
    return (RecoverableError, *lost_worker_errors())


@contextlib.contextmanager
def retry_on_lost_workers(phase: str) -> Iterator[None]:
    """Re-raise recoverable failures of `phase` as FlyteRecoverableException (chained, message kept)."""
    try:
        yield
    except recoverable_types() as exc:
        raise FlyteRecoverableException(
            f"{phase}: {type(exc).__name__}: {exc} (retrying from the last checkpoint)"
        ) from exc
