#!/usr/bin/env bash
# The GPU benchmark in one command, on a machine with NVIDIA GPUs and the project installed
# (pip install -e . with a CUDA build of torch). Nothing is downloaded. Prints one table:
# NCCL path, gpt2 (124M) tokens/s, MFU and peak memory in bf16 with compile, the compile speed-up, fsdp against ddp,
# the async snapshot stall, and the time from a kill -9 to the next step. See bench/bench_gpu.py.
#
#   bash bench/gpu.sh [--steps 300] [--micro-batch 16] [--model gpt2]
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
exec python bench/bench_gpu.py "$@"
