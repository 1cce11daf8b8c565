#!/usr/bin/env bash
# On the GPU machine after tools/gpu/prepare-8b.sh: does a RidgeFill request slow the stock requests after it
# (issue 7: the exact arm ran 6-9% slower than upstream on 2026-12-01)? tools/bench_stock_after.py on the
# Qwen3-8B-shaped model, with and without CUDA graphs. Results in $OUT/bench.   [TOKENS=32768] bash ...
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
export PYTHONPATH="/tmp/site:$repo" PYTHONUNBUFFERED=1 LD_PRELOAD=${LD_PRELOAD:-/lib/x86_64-linux-gnu/libstdc++.so.6}
cd "$repo"
python3 tools/bench_stock_after.py "$work/qwen3-8b-q8_0.gguf" "$work/qwen3-8b-q8_0.S13.maps.gguf" \
    --tokens "${TOKENS:-32768}" --small 8192 --tail 4096 --repeats 3 --idle 20 --no-graphs -ngl 99 \
    --extra="--override-kv qwen3.context_length=int:131072" --label qwen3-8b-q8_0-h200 --results "${OUT:-results}/bench"
