#!/usr/bin/env bash
# Headless Chromium for tests/browser (the decks rendered in flytekit's deck page). Idempotent; needs root (CI is).
set -euo pipefail
command -v chromium >/dev/null || (apt-get update && apt-get install -y --no-install-recommends chromium)
chromium --version
