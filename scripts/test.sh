#!/usr/bin/env bash
# The test command of the README: the whole suite except slow real-model tests (run those with `-m slow`).
# Uses the repo's .venv (made by scripts/setup.sh) so it works from a plain shell without activating anything.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_AUTH_MODE=disabled
if [ ! -x .venv/bin/python ]; then
  echo "no .venv here: run 'bash scripts/setup.sh' first" >&2
  exit 2
fi
exec .venv/bin/python -m pytest -q -m "not slow" "$@"
