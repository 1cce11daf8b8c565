#!/usr/bin/env bash
# On the GPU machine after a build (tools/gpu/prepare-8b.sh or build-and-test.sh --build-only): upstream's
# ggml_gated_delta_net alone at a hybrid's head shape (default the 27B preset's: 128-wide heads, 16 key heads,
# 48 value heads), TOKENS rows in one sequence or split into SEQS. Result: $OUT/bench/gdn-LABEL.json
#   [SHAPE="128 16 48"] [TOKENS=512,4096,32768] [SEQS=1,8,64] [LABEL=...] bash tools/gpu/bench-gdn.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
bin="$work/out-ridgefill/bin"
[ -d "$bin" ] || bin="$work/out-upstream/bin"
g++ -O2 -std=c++17 "$repo/tools/gpu/gdn_bench.cpp" -I "$work/src/ggml/include" -L "$bin" -lggml -lggml-base \
    -Wl,-rpath,"$bin" -o "$work/gdn_bench"
out="${OUT:-$repo/results}/bench"
mkdir -p "$out"
# shellcheck disable=SC2086 # SHAPE is three numbers
"$work/gdn_bench" ${SHAPE:-128 16 48} "${TOKENS:-512,4096,32768}" "${SEQS:-1,8,64}" "${REPEATS:-5}" \
    > "$out/gdn-${LABEL:-qwen35-27b-h200}.json"
cat "$out/gdn-${LABEL:-qwen35-27b-h200}.json"
