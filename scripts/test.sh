#!/usr/bin/env bash
# The test command of the README: the whole suite except slow real-model tests (run those with `-m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_AUTH_MODE=disabled
exec python -m pytest -q -m "not slow" "$@"
