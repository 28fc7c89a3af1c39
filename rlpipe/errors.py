"""Exceptions that carry enough context for a user to fix their input without reading a traceback."""

from __future__ import annotations


class RlpipeError(Exception):
    """Base class of every error rlpipe raises on purpose."""


class ConfigError(RlpipeError):
    """A configuration value is missing, malformed or inconsistent."""


class DataError(RlpipeError):
    """Bad input data; the message names the file, the row and the field when they are known."""

    def __init__(self, message: str, *, file: str | None = None, row: int | None = None, field: str | None = None):
        self.file = file
        self.row = row
        self.field = field
        where = []
        if file is not None:
            where.append(f"file {file}")
        if row is not None:
            where.append(f"row {row}")
        if field is not None:
            where.append(f"field {field!r}")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)


class CheckpointError(RlpipeError):
    """A checkpoint is missing, incomplete, tampered with, or belongs to another model."""


class RolloutServerError(RlpipeError):
    """An inference server failed to answer correctly after the configured retries."""


class RecoverableError(RlpipeError):
    """A failure a retry can fix (a Ray actor or node lost); the Flyte layer maps it to a recoverable exception."""


class WeightSyncError(RolloutServerError):
    """The inference engine does not serve the policy's weights after a sync (a partial or failed load)."""
