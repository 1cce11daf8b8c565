#!/usr/bin/env bash
# On the GPU machine: build the patched tree (CUDA) and, meanwhile, write a random Qwen3-8B-shaped q8_0 GGUF
# (about 3-4 min) and near-identity maps for split 13, so one call leaves everything the 8B benchmarks need.
#   bash tools/gpu/prepare-8b.sh            (carry .cache/device/llama.cpp and .whl)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
mkdir -p "$work"
# PRESET, DTYPE and SPLIT choose the model (tools/gpu/write-8b.sh)
bash "$repo/tools/gpu/write-8b.sh" > "$work/prepare-8b.log" 2>&1 &
gen=$!
RIDGEFILL_GPU_TREES=${RIDGEFILL_GPU_TREES:-ridgefill upstream} bash "$repo/tools/gpu/build-and-test.sh" --build-only
wait $gen || { tail -20 "$work/prepare-8b.log"; exit 1; }
tail -3 "$work/prepare-8b.log"
