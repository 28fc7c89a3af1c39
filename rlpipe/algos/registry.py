"""Name lookup for the algorithm registries, with an error that lists what is known.

A wrong name in a config (``algo.advantage: grpoo``) should fail with the list of valid names, not a KeyError.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from rlpipe.errors import ConfigError

T = TypeVar("T")


class UnknownNameError(ConfigError, ValueError):
    """An algorithm name not in its registry. A ``ValueError`` (callers may catch that) and an ``RlpipeError``."""


def lookup(registry: Mapping[str, T], name: str, what: str) -> T:
    """``registry[name]``, or ``UnknownNameError`` naming ``what`` and the known names."""
    try:
        return registry[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(registry))
        raise UnknownNameError(f"unknown {what} {name!r}; known: {known}") from None
