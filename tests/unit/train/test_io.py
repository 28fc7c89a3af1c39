"""rlpipe.io: atomic writes leave old-or-new, strict JSON reads, hashes against naive references."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from rlpipe import io
from rlpipe.errors import CheckpointError, ConfigError, DataError


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if ".tmp-" in p.name)


def test_atomic_write_bytes_creates_and_overwrites(tmp_path):
    target = tmp_path / "sub" / "a.bin"
    io.atomic_write_bytes(target, b"one")
    assert target.read_bytes() == b"one"
    io.atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    assert _leftovers(target.parent) == []


def test_failed_replace_keeps_old_content_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    io.atomic_write_json(target, {"v": 1})
    seen = []

    def boom(src, dst):
        seen.append(Path(src).name)
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        io.atomic_write_json(target, {"v": 2})
    assert json.loads(target.read_text()) == {"v": 1}
    # the temp name followed the documented pattern and was cleaned up
    assert len(seen) == 1 and seen[0].startswith(f"state.json.tmp-{os.getpid()}-")
    assert _leftovers(tmp_path) == []


def test_atomic_write_json_roundtrip_sorted_and_paths(tmp_path):
    target = io.atomic_write_json(tmp_path / "x.json", {"b": 1, "a": Path("/p/q"), "s": {3, 1}})
    text = target.read_text()
    assert text.index('"a"') < text.index('"b"')
    assert json.loads(text) == {"a": "/p/q", "b": 1, "s": [1, 3]}
    io.atomic_write_text(tmp_path / "t.txt", "héllo")
    assert (tmp_path / "t.txt").read_bytes() == "héllo".encode()


def test_uri_is_refused_for_writes(tmp_path):
    with pytest.raises(ConfigError, match="local paths only"):
        io.atomic_write_bytes("s3://bucket/key", b"x")


def test_read_json_errors_name_file_and_position(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1,\n  "b": }')
    with pytest.raises(DataError) as ei:
        io.read_json(bad, what="sampler state")
    msg = str(ei.value)
    assert str(bad) in msg and "sampler state" in msg and "line 2" in msg
    assert ei.value.file == str(bad)
    with pytest.raises(CheckpointError, match="not found"):
        io.read_json(tmp_path / "missing.json", error=CheckpointError)
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\x80\x04\x95\xff")
    with pytest.raises(DataError, match="not UTF-8"):
        io.read_json(binary)
    good = tmp_path / "good.json"
    good.write_text('[1, {"x": null}]')
    assert io.read_json(good) == [1, {"x": None}]


def test_sha256_file_matches_hashlib_across_chunks(tmp_path):
    data = os.urandom(io._CHUNK * 2 + 12345)
    f = tmp_path / "big"
    f.write_bytes(data)
    assert io.sha256_file(f) == hashlib.sha256(data).hexdigest()
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert io.sha256_file(empty) == hashlib.sha256(b"").hexdigest()


def _naive_tree_hash(root: Path, skip: set[str]) -> str:
    entries = []
    for p in root.rglob("*"):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in skip:
            entries.append((rel, hashlib.sha256(p.read_bytes()).hexdigest()))
    h = hashlib.sha256()
    for rel, digest in sorted(entries):
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()


def test_sha256_tree_reference_skip_and_sensitivity(tmp_path):
    (tmp_path / "w" / "deep").mkdir(parents=True)
    (tmp_path / "w" / "a.bin").write_bytes(b"aaa")
    (tmp_path / "w" / "deep" / "b.bin").write_bytes(b"bbb")
    (tmp_path / "c.json").write_text("{}")
    h0 = io.sha256_tree(tmp_path)
    assert h0 == _naive_tree_hash(tmp_path, {"manifest.json"})
    assert io.sha256_files(tmp_path) == {
        "c.json": hashlib.sha256(b"{}").hexdigest(),
        "w/a.bin": hashlib.sha256(b"aaa").hexdigest(),
        "w/deep/b.bin": hashlib.sha256(b"bbb").hexdigest(),
    }
    (tmp_path / "manifest.json").write_text("anything")
    assert io.sha256_tree(tmp_path) == h0  # skipped
    assert io.sha256_tree(tmp_path, skip=()) != h0
    (tmp_path / "w" / "a.bin").rename(tmp_path / "w" / "a2.bin")
    assert io.sha256_tree(tmp_path) != h0  # a rename changes the tree hash
    (tmp_path / "w" / "a2.bin").rename(tmp_path / "w" / "a.bin")
    assert io.sha256_tree(tmp_path) == h0
    (tmp_path / "w" / "deep" / "b.bin").write_bytes(b"bbc")
    assert io.sha256_tree(tmp_path) != h0


def test_fsync_tree_syncs_every_file_and_dir(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    for p in ["x", "a/y", "a/b/z"]:
        (tmp_path / p).write_text(p)
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd) or real(fd))
    io.fsync_tree(tmp_path)
    assert len(calls) == 3 + 3  # three files, three directories


def test_stable_hash_canonical():
    a = {"b": [1, 2, {"z": 1, "y": 2}], "a": "x"}
    b = {"a": "x", "b": [1, 2, {"y": 2, "z": 1}]}
    assert io.stable_hash(a) == io.stable_hash(b)
    assert io.stable_hash(a) != io.stable_hash({**a, "a": "y"})
    assert io.stable_hash([1, 2]) != io.stable_hash([2, 1])
    assert io.stable_hash({"k": 1}) == hashlib.sha256(b'{"k":1}').hexdigest()
    with pytest.raises(ValueError):
        io.stable_hash({"x": float("nan")})
