#!/usr/bin/env bash
# The voice-agent frameworks against /v1/realtime: the OpenAI Agents SDK, Pipecat and LiveKit
# Agents, each driven as its docs say, against a real gateway + tritonserver (tiny model) that the tests
# start from the project's .venv. Builds .venv-frameworks from tests_frameworks/requirements.txt (pinned;
# rebuilt when that file changes). Run scripts/setup.sh first. Usage: bash scripts/frameworks.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-frameworks
lock=tests_frameworks/requirements.txt
want=$(sha256sum "$lock" | cut -c1-16)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.lock-sha" 2>/dev/null)" != "$want" ]; then
  PY=${PYTHON:-python3.11}
  command -v "$PY" >/dev/null || PY=python3
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >/dev/null
  "$venv/bin/pip" install -q -r "$lock"
  echo "$want" > "$venv/.lock-sha"
fi
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests_frameworks "$@"
