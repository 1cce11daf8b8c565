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
# PRESET (qwen3-8b | llama-3.1-8b), DTYPE (q8_0 | q4_k_m) and SPLIT (3/8 of depth: 13 | 12) choose the model
preset=${PRESET:-qwen3-8b} dtype=${DTYPE:-q8_0} split=${SPLIT:-13}
model="$work/$preset-$dtype.gguf"
maps="$work/$preset-$dtype.S$split.maps.gguf"
(
    # the vocab from the carried tree: vendor/ is linked only once the builds are done
    vocab=$([ "${preset%%-*}" = llama ] && echo ggml-vocab-llama-bpe.gguf || echo ggml-vocab-qwen2.gguf)
    [ -f "$model" ] || python3 -m ridgefill_gguf.random_gguf --preset "$preset" --dtype "$dtype" -o "$model" \
        --vocab "$repo/.cache/device/llama.cpp/models/$vocab"
    [ -f "$maps" ] || python3 -m ridgefill_gguf.maps.synthetic --model "$model" --split "$split" -o "$maps"
) > "$work/prepare-8b.log" 2>&1 &
gen=$!
RIDGEFILL_GPU_TREES=${RIDGEFILL_GPU_TREES:-ridgefill upstream} bash "$repo/tools/gpu/build-and-test.sh" --build-only
wait $gen || { tail -20 "$work/prepare-8b.log"; exit 1; }
tail -3 "$work/prepare-8b.log"
ls -la "$model" "$maps"
