#!/usr/bin/env bash
# The prepared GPU check: make sure torch has CUDA, run the GPU-marked tests, then
# `forwardkit bench` on the built-in model and on a real model shape (MODEL_SHAPE, default
# llama-3.2-1b) for eager, stock torch.compile(mode="reduce-overhead") and forwardkit with
# -O.cudagraph_mode=PIECEWISE / FULL_DECODE_ONLY / FULL_AND_PIECEWISE; one summary table.
# Sized to finish within 8 minutes on one H200.
#
#   scripts/gpu_check.sh               # on a GPU machine, from the repository root
#   scripts/gpu_check.sh --dry-run     # the same steps on the CPU with tiny sizes
#
# Other options go to scripts/gpu_check.py (--trace, --steps, --out-dir, --budget-s, ...).
# TORCH_INDEX_URL picks the wheel index used when torch has no CUDA (default cu128).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python}"
MODEL_SHAPE="${MODEL_SHAPE:-llama-3.2-1b}"
export MODEL_SHAPE

dry_run=0
for arg in "$@"; do
  [[ "$arg" == "--dry-run" ]] && dry_run=1
done

if [[ $dry_run == 0 ]]; then
  if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    version="$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')"
    index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}"
    echo "gpu_check: torch $version has no CUDA here; installing the CUDA build from $index" >&2
    if ! "$PYTHON" -m pip install --quiet --index-url "$index" "torch==$version"; then
      echo "gpu_check: could not install a CUDA build of torch $version (no network or no such" \
           "wheel); install one and rerun" >&2
      exit 2
    fi
    "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
      echo "gpu_check: torch still sees no GPU (driver or device missing)" >&2; exit 2; }
  fi
  "$PYTHON" -c "import torch; print('gpu_check:', torch.__version__, torch.cuda.get_device_name(0))"
fi

exec "$PYTHON" scripts/gpu_check.py "$@"
