#!/usr/bin/env bash
# The GPU check, one command on a machine with one NVIDIA GPU (about 8 minutes, no network):
#   bash benchmarks/gpu_check.sh [--out DIR] [--peak-tflops X]
# 1. the GPU test tier (python -m pytest -m gpu) with PYTHONFAULTHANDLER=1, so a segfault names its Python line;
# 2. 05 at GPT-2 124M's shape, --impl manual|torch x eager|--compile, and the same model with no DDP compiled
#    whole: tokens/s, MFU and each run against that ceiling, as a markdown table and as JSON (DIR/gpu_check.json).
# Without CUDA it says so in one line and runs nothing. Exit status: 0 all ran and passed, 1 something failed,
# 2 nothing ran (no CUDA GPU, or a bad flag). The steps, and --tiny (the same on the CPU): benchmarks/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/gpu_check.py "$@"
