#!/usr/bin/env bash
# The device engine core on one GPU with no checkpoint (bench/gpu_check.py), random weights at MiniCPM-o 4.5's dims,
# rows scripted: parity (CUDA graphs vs eager, flex vs gather, one wait per decode iteration: the run FAILS past its
# thresholds), ms per LLM and TTS iteration at 32/64/128/256 rows with and without graphs, the whole duplex step
# loop (Whisper, LLM, TTS, token2wav; staggered sessions, 30% speaking: p50/p95 of a speaking step at
# 32/64/128/256 sessions), the TTS's and the Whisper's parity and speed; pool memory; token2wav's device path
# (bench/gpu_check_token2wav.py: the waveform against the CPU's fp32 with bf16 and fp32 caches, ms per iteration at
# 8/32/64/128 speaking sessions through the CUDA graphs, memory per slot).
# Results under $OUT (default ./gpu_out). Needs python3 with torch (CUDA) and numpy; nothing is downloaded.
# Under 8 minutes (speed starts no new size past 240 s, step within 150 s of its start, TTS+Whisper within 60 s).
#   scripts/gpu_check.sh                      # on the GPU
#   scripts/gpu_check.sh --stages step        # a subset (of parity, speed, step, tts, whisper, token2wav)
#   scripts/gpu_check.sh --device cpu --quick # the same code at small dims, to test the script
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
{
  echo "date: $(date -u +%FT%TZ)"
  echo "python: $(command -v "$PY" || echo MISSING) $("$PY" --version 2>&1)"
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>&1 || echo "nvidia-smi: MISSING"
} | tee "$OUT/env.txt"
if ! "$PY" - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import importlib, sys
missing = []
for name in ("numpy", "torch"):
    try:
        mod = importlib.import_module(name)
        print(f"{name}: {mod.__version__}")
    except ImportError:
        missing.append(name)
if "torch" not in missing:
    import torch
    print(f"cuda available: {torch.cuda.is_available()} (torch built for CUDA {torch.version.cuda})")
    try:
        import triton
        print(f"triton: {triton.__version__} (torch.compile's GPU kernels)")
    except ImportError:
        print("triton: MISSING (flex_attention cannot compile: the check falls back to what runs)")
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        print("flex_attention: importable")
    except ImportError:
        print("flex_attention: MISSING (torch too old)")
if missing:
    print(f"MISSING: {' '.join(missing)}: install them (pip install torch numpy) and run again")
    sys.exit(1)
EOF
then
  echo "gpu_check: cannot run (see $OUT/env.txt)"
  exit 2
fi
timeout 470 "$PY" -m bench.gpu_check --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
