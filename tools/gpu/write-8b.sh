#!/usr/bin/env bash
# On the GPU machine: write a random-weight 8B-shaped GGUF and near-identity maps for its split, under
# $HOME/ridgefill (a file already there is kept). PRESET (qwen3-8b | llama-3.1-8b | qwen35-27b | qwen3next-80b-e64 | gemma3-12b | gemma3-270m),
# DTYPE (q8_0 | q4_k_m) and SPLIT (3/8 of depth: 13 | 12; the hybrids a quarter: 16 | 12) choose the model. Beside a build: setsid bash tools/gpu/write-8b.sh > log 2>&1 &
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
mkdir -p "$work"
bash "$repo/tools/gpu/site.sh"
export PYTHONPATH="/tmp/site:$repo" PYTHONUNBUFFERED=1
preset=${PRESET:-qwen3-8b} dtype=${DTYPE:-q8_0} split=${SPLIT:-13}
model="$work/$preset-$dtype.gguf"
maps="$work/$preset-$dtype.S$split.maps.gguf"
# the vocab from the carried tree: vendor/ is linked only once the builds are done
case "$preset" in
    llama*)  vocab=ggml-vocab-llama-bpe.gguf ;;
    qwen35*) vocab=ggml-vocab-qwen35.gguf ;;
    gemma3*) vocab=ggml-vocab-gemma-4.gguf ;;
    *)       vocab=ggml-vocab-qwen2.gguf ;;
esac
# the large shapes: every layer of a kind holds the same random weights (minutes less; speed does not depend on them)
same=$(case "$preset" in qwen35-27b|qwen3next-*|gemma3-12b) echo --same-layers ;; esac)
[ -f "$model" ] || python3 -m ridgefill_gguf.random_gguf --preset "$preset" --dtype "$dtype" -o "$model" \
    --vocab "$repo/.cache/device/llama.cpp/models/$vocab" $same
[ -f "$maps" ] || python3 -m ridgefill_gguf.maps.synthetic --model "$model" --split "$split" -o "$maps"
ls -la "$model" "$maps"
