#!/usr/bin/env bash
# On the GPU machine after tools/gpu/prepare-8b.sh: is sweep one's extra time RidgeFill's or llama.cpp's?
# Writes the same random Qwen3-8B shape cut to its first 13 layers (same seed: same weights) and runs
# tools/bench_early_control.py (docs/gpu.md, issue 7). Results in $OUT/bench.   TOKENS=16384,32768,65536 bash ...
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
export PYTHONPATH="/tmp/site:$repo" PYTHONUNBUFFERED=1 LD_PRELOAD=${LD_PRELOAD:-/lib/x86_64-linux-gnu/libstdc++.so.6}
early="$work/qwen3-8b-q8_0-first13.gguf"
[ -f "$early" ] || python3 -m ridgefill_gguf.random_gguf --preset qwen3-8b --layers 13 --dtype q8_0 -o "$early" \
    --vocab "$repo/.cache/device/llama.cpp/models/ggml-vocab-qwen2.gguf"
cd "$repo"
python3 tools/bench_early_control.py "$work/qwen3-8b-q8_0.gguf" "$work/qwen3-8b-q8_0.S13.maps.gguf" "$early" \
    --tokens "${TOKENS:-16384,32768,65536}" --tail 4096 --repeats "${REPEATS:-3}" -ngl 99 \
    --extra="--override-kv qwen3.context_length=int:131072" --results "${OUT:-results}/bench"
