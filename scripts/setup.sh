#!/usr/bin/env bash
# Set up a fresh Debian/Ubuntu machine: system packages, a virtualenv with the project, the tiny model.
# Idempotent; re-run it after pulling. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v espeak-ng >/dev/null || need_apt+=(espeak-ng)
dpkg -s libb64-0d >/dev/null 2>&1 || need_apt+=(libb64-0d)  # perf_analyzer
dpkg -s libsndfile1 >/dev/null 2>&1 || need_apt+=(libsndfile1)
command -v chromium >/dev/null || need_apt+=(chromium)  # the browser page's test (headless, via Playwright)
command -v prometheus >/dev/null || need_apt+=(prometheus)  # the ops tests' real Prometheus (tests/test_ops_metrics.py)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip >/dev/null
# torch==2.13.0 is pinned in the export extra: a CPU build, no multi-GB CUDA download.
.venv/bin/pip install -q -e '.[dev]'
# The official Step-Audio2 token2wav modules (flow matching, DiT, conformer, HiFT), without their pinned
# dependencies: export/modules/stepaudio2.py imports the modules it needs without the package __init__,
# which imports torchaudio (no torchaudio build loads with torch 2.13).
.venv/bin/pip install -q --no-deps minicpmo-utils==1.0.7

# Export the tiny preset (random weights, ~40 s on 2 cores) unless its artefacts are current.
stamp=model_repository/.export-stamp
# (the export runs minicpmo_triton's code too: the mel, the image slicing, the voice-prompt features)
src_hash=$(find export minicpmo_triton -name "*.py" -not -path "*/__pycache__/*" | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "tiny-$src_hash" ] || [ ! -f model_repository/llm/1/model.onnx ] \
    || [ ! -f model_repository/audio_encoder/1/stream.onnx ] || [ ! -f model_repository/token2wav/1/campplus.onnx ] \
    || [ -d model_repository/speaker_encoder ]; then  # a retired model's leftovers: the export removes them
  .venv/bin/python -m export --preset tiny
  echo "tiny-$src_hash" > "$stamp"
fi
echo "setup done: .venv ready, tiny model exported to model_repository/"
