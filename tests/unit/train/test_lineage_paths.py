"""Parents written by a session resolve from any working directory, even with a relative checkpoint root."""

import os

from rlpipe.session import _absolute


def test_relative_locations_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _absolute("runs/checkpoints/x/step-000001") == os.path.join(str(tmp_path), "runs/checkpoints/x/step-000001")
    assert _absolute("s3://bucket/runs/step-000001") == "s3://bucket/runs/step-000001"
