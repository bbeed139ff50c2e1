#!/usr/bin/env bash
# The container's Python (the Dockerfile's `ARG PYTHON`): a venv on it, the project without torch (no CPU torch
# wheel for it here: PyPI's is a multi-GB CUDA build), and every test module whose imports are installed,
# tritonserver ones included (nvidia-pytriton ships a Python backend stub per Python). Run after scripts/setup.sh,
# which exported the tiny model with Python 3.11's torch.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^ARG PYTHON=//p' Dockerfile)
py=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$version".*/bin/python 2>/dev/null | sort -V | tail -1 || true)
[ -n "$py" ] || py=$(command -v "python$version" || true)
"${py:-false}" -c "" 2>/dev/null || { echo "no Python $version here (the container's, from the Dockerfile)"; exit 1; }
venv=.venv-py$version
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip >/dev/null
"$venv/bin/pip" install -q -e '.[server,test]'
# As in the Dockerfile: silero-vad without the torch it declares (the gateway reads its ONNX file only).
"$venv/bin/pip" install -q --no-deps "silero-vad==$(sed -n 's/.*"silero-vad==\([0-9.]*\)".*/\1/p' pyproject.toml)"
"$venv/bin/python" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$version', sys.version"
# The healing tests too (their stubs run on this Python); the device engines need torch; the ops tests' Prometheus
# and traces ran in their own step (their stubs import the same modules the tests here load on this Python); the JS
# clients' types do not depend on the Python (their own step in .ci/run).
MINICPMO_TEST_SUBSET=installed "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    -m 'not fleet and not slow and not checkpoints and not engines and not ops and not jstypes and not reference and not hostile'
