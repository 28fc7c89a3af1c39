"""Crash-safe local file writes, strict JSON reads and content hashes.

Why atomic: a reader (a resumed run, the lineage CLI, another Flyte task) must see either the old file or the new
one, never a torn write. The recipe is POSIX's: write to a unique temporary name in the *same* directory (so the
rename stays on one filesystem), flush + fsync the file, ``os.replace`` onto the target (atomic on POSIX), then
fsync the directory so the rename itself survives a power loss.

Writes are local-only: remote stores (s3://, gs://) are written by Flyte when it uploads a finished directory.
Remote *reads* (for lineage) live in ``rlpipe.train.lineage`` via fsspec.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlpipe.errors import ConfigError, DataError, RlpipeError

_CHUNK = 1 << 20


def local_path(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` as a Path, refusing URIs: writing to ``s3:/bucket`` as a local dir would silently misbehave."""
    text = os.fspath(path)
    if "://" in text:
        raise ConfigError(f"{text!r} is a URI; rlpipe writes local paths only (Flyte uploads finished outputs)")
    return Path(text)


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
"""A user-given name that becomes one path component or object-store key: 1-128 characters of ASCII letters,
digits, ``.``, ``_`` and ``-``, starting with a letter or digit (so never ``.``, ``..``, absolute, hidden, or holding a
separator, a control character, NUL or a newline)."""

_NAME_RE = re.compile(NAME_PATTERN)


def check_name(value: str, field: str) -> str:
    """Return ``value`` if it is a safe name (``NAME_PATTERN``, no ``..``), else raise ValueError naming ``field``.

    Why: names from a launch's inputs are joined onto shared roots; one with ``/`` or ``..`` would write into
    another experiment's (or team's) directory.
    """
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value) or ".." in value:
        raise ValueError(
            f"{field}={value!r} is not a valid name: use 1-128 characters of letters, digits, '.', '_' and '-', "
            "starting with a letter or digit, without '..' (it becomes one directory name)"
        )
    return value


def inside_root(root: str | os.PathLike[str], *parts: str | os.PathLike[str]) -> Path:
    """``root / parts`` after checking that it resolves inside ``root`` (symlinks and ``..`` followed).

    Defence in depth for names that reach a write without config validation (a manifest, a Flyte input):
    raises ConfigError naming the path and the root instead of writing outside it.
    """
    base = local_path(root)
    target = base.joinpath(*parts)
    for part in (os.fspath(p) for p in parts):
        if any(ord(c) < 32 or ord(c) == 127 for c in part):
            raise ConfigError(f"path component {part!r} under {base} holds a control character")
    real_base, real_target = os.path.realpath(base), os.path.realpath(target)
    if os.path.commonpath([real_base, real_target]) != real_base or (parts and real_target == real_base):
        raise ConfigError(f"path {target} resolves to {real_target}, outside its root {real_base}; refusing to write")
    return target


def check_writable_dir(path: str | os.PathLike[str], key: str) -> None:
    """Raise ConfigError naming ``key`` if ``path`` could not be created and written, without creating it.

    Why: an unwritable checkpoint root used to be found at the first save, after a whole segment of training.
    The nearest existing ancestor must be a directory in which a probe file can be created (and is removed).
    """
    p = Path(os.path.abspath(local_path(path)))
    existing = next(a for a in (p, *p.parents) if os.path.lexists(a))
    if not existing.is_dir():
        raise ConfigError(f"{key}={os.fspath(path)!r} cannot be created: {existing} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".rlpipe-write-probe-", dir=existing)
    except OSError as e:
        raise ConfigError(f"{key}={os.fspath(path)!r} is not writable: {e}") from None
    os.close(fd)
    os.unlink(probe)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so renames/creations inside it are durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically: temp file ``<path>.tmp-<pid>-<rand>``, fsync, rename, fsync dir."""
    target = local_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """UTF-8 text version of ``atomic_write_bytes``."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def _json_default(obj: Any) -> Any:
    """Encode the few non-JSON types rlpipe passes around (paths, pydantic models, dataclasses, sets, numpy)."""
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    if hasattr(obj, "tolist"):  # numpy scalars/arrays
        return obj.tolist()
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable")


def dumps_json(obj: Any, indent: int | None = 2) -> str:
    """Readable JSON text (sorted keys so diffs of state files are stable)."""
    return json.dumps(obj, indent=indent, sort_keys=True, default=_json_default) + "\n"


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write ``obj`` as indented, key-sorted JSON atomically."""
    return atomic_write_text(path, dumps_json(obj))


def read_json(path: str | os.PathLike[str], what: str = "JSON file", error: type[RlpipeError] = DataError) -> Any:
    """Parse a JSON file; a missing, non-UTF-8 or malformed file raises ``error`` naming ``what``, the path and position.

    ``error`` is ``DataError`` by default (gets ``file=``); pass ``CheckpointError`` for checkpoint files.
    """
    p = Path(os.fspath(path))

    def fail(msg: str) -> RlpipeError:
        if issubclass(error, DataError):
            return error(f"{what}: {msg}", file=str(p))
        return error(f"{what} {p}: {msg}")

    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise fail("file not found") from None
    except OSError as e:
        raise fail(f"cannot read ({e.strerror})") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise fail("not UTF-8 text, so not JSON") from None
    except json.JSONDecodeError as e:
        raise fail(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of bytes."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's contents, read in 1 MiB chunks (checkpoint shards can be large)."""
    h = hashlib.sha256()
    with open(os.fspath(path), "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def iter_files(root: str | os.PathLike[str], skip: Iterable[str] = ()) -> list[str]:
    """Sorted POSIX relative paths of every regular file under ``root``, minus the relative paths in ``skip``."""
    base = Path(os.fspath(root))
    skipped = set(skip)
    out = []
    for dirpath, _dirs, files in os.walk(base):
        for name in files:
            rel = (Path(dirpath) / name).relative_to(base).as_posix()
            if rel not in skipped:
                out.append(rel)
    return sorted(out)


def sha256_files(root: str | os.PathLike[str], skip: Iterable[str] = ()) -> dict[str, str]:
    """``{relative_path: sha256}`` for every file under ``root`` except ``skip`` (what a manifest lists)."""
    base = Path(os.fspath(root))
    return {rel: sha256_file(base / rel) for rel in iter_files(base, skip)}


def sha256_tree(root: str | os.PathLike[str], skip: Iterable[str] = ("manifest.json",)) -> str:
    """One hash for a directory: sha256 over ``path NUL sha256(content) LF`` of its files in sorted path order.

    Paths are part of the hash so a renamed file changes it; ``skip`` (the manifest by default) is left out so
    the manifest can carry the tree hash of the directory it lives in.
    """
    h = hashlib.sha256()
    for rel, digest in sha256_files(root, skip).items():
        h.update(rel.encode("utf-8") + b"\0" + digest.encode("ascii") + b"\n")
    return h.hexdigest()


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every file, then every directory bottom-up, so a later rename publishes durable contents."""
    for dirpath, _dirs, files in os.walk(os.fspath(root), topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def canonical_json(obj: Any) -> str:
    """Canonical JSON (sorted keys, no whitespace, ASCII, no NaN) so equal objects give equal text."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False, default=_json_default
    )


def stable_hash(obj: Any) -> str:
    """Hex sha256 of ``canonical_json(obj)``; used for config hashes and model fingerprints."""
    return sha256_bytes(canonical_json(obj).encode("ascii"))
