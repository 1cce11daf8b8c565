#!/usr/bin/env bash
# On the GPU machine: build the patched tree (CUDA) and, meanwhile, write a random Qwen3-8B-shaped q8_0 GGUF
# (about 3-4 min) and near-identity maps for split 13, so one call leaves everything the 8B benchmarks need.
#   bash tools/gpu/prepare-8b.sh            (carry .cache/device/llama.cpp and .whl)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
mkdir -p "$work"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$repo"/.whl/*.whl
export PYTHONPATH="/tmp/site:$repo" PYTHONUNBUFFERED=1
model="$work/qwen3-8b-q8_0.gguf"
maps="$work/qwen3-8b-q8_0.S13.maps.gguf"
(
    # the vocab from the carried tree: vendor/ is linked only once the builds are done
    [ -f "$model" ] || python3 -m ridgefill_gguf.random_gguf --preset qwen3-8b --dtype q8_0 -o "$model" \
        --vocab "$repo/.cache/device/llama.cpp/models/ggml-vocab-qwen2.gguf"
    [ -f "$maps" ] || python3 -m ridgefill_gguf.maps.synthetic --model "$model" --split 13 -o "$maps"
) > "$work/prepare-8b.log" 2>&1 &
gen=$!
RIDGEFILL_GPU_TREES=${RIDGEFILL_GPU_TREES:-ridgefill upstream} bash "$repo/tools/gpu/build-and-test.sh" --build-only
wait $gen || { tail -20 "$work/prepare-8b.log"; exit 1; }
tail -3 "$work/prepare-8b.log"
ls -la "$model" "$maps"
