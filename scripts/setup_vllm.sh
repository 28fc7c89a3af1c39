#!/usr/bin/env bash
# Create .venv-vllm: the separate venv of the vLLM CPU server that `rollout.engine=vllm` starts.
# vLLM pins transformers<5.20 (rlpipe uses newer), so it cannot share .venv; it runs as its own process anyway.
# torch goes first from the CPU wheel; then the exact pinned set with --no-deps (no resolver surprises, and no
# torchvision/torchaudio, whose wheels do not match this torch). Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "$VENV: vLLM already installed"
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q --no-deps -r scripts/requirements-vllm.txt
"$VENV/bin/python" -c "import vllm, torch; print(f'$VENV: vllm {vllm.__version__} on torch {torch.__version__}')"
