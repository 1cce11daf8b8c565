#!/usr/bin/env bash
# On the GPU machine, after `tools/gpu/build-and-test.sh --build-only`: capture speed against plain prefill and
# solve time for an 8B-shaped random-weight model (issue 4). Results land in $OUT (and results/capture/).
#   bash tools/gpu/bench-capture-8b.sh [qwen3-8b|llama-3.1-8b] [split]
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
preset=${1:-qwen3-8b}
split=${2:-13}
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
export PYTHONPATH="/tmp/site:$repo" PYTHONUNBUFFERED=1 LD_PRELOAD=${LD_PRELOAD:-/lib/x86_64-linux-gnu/libstdc++.so.6}
model="$work/$preset-q8_0.gguf"
[ -f "$model" ] || python3 -m ridgefill_gguf.random_gguf --preset "$preset" --dtype q8_0 -o "$model"
# text that is on every machine: the interpreter's own standard library sources
stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
cd "$repo"
python3 tools/bench_capture.py "$model" --split "$split" --text "$stdlib/email" "$stdlib/json" "$stdlib/asyncio" \
    --docs 4 --tokens 4096 --n-gpu-layers -1 --results "${OUT:-results}/capture"
