#!/usr/bin/env bash
# On a machine of several GPUs (device kind nvidia-h100-x2/-x4 or nvidia-h200-x2/-x4), after
# PRESET=qwen35-27b DTYPE=q8_0 SPLIT=16 bash tools/gpu/prepare-8b.sh (both CUDA builds and the random model): the
# layer-split runs, each under its own time limit, results and server logs packed into one $OUT/multi-gpu.tar.xz.
#   RUNS="tests split32k one32k split64k one64k split128k one128k" [LIMIT_S=240] bash tools/gpu/multi-gpu-runs.sh
# (splitNk and oneNk take any N: the prompt's length in K tokens)
# tests: the layer-split GPU tests and the CUDA equivalence tests, which see every GPU (llama.cpp's default split is
# by layer). splitNk: RidgeFill plain and the default selector against stock on the same server, resident and
# streamed, on llama.cpp's layer split over every visible GPU (TS=3,1 sets --tensor-split), and at 32K and 64K
# upstream's server on the same split. oneNk: the same on the first GPU alone (CUDA_VISIBLE_DEVICES=0), without
# upstream (two servers of the 27B at 128K would not fit one H100). Each row records each GPU's peak memory and busy
# share (nvidia-smi) and the bytes RidgeFill's graphs moved between devices. PLACEMENTS=streamed: streamed maps alone
# (resident ones of the 27B at 128K may not fit one H100).
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out="${OUT:-$repo/results}"
export PRESET=${PRESET:-qwen35-27b} DTYPE=${DTYPE:-q8_0} SPLIT=${SPLIT:-16} REPEATS=${REPEATS:-1} SELECT=${SELECT:-probe}
gpus=$(nvidia-smi -L | grep -c "^GPU ")
kind=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 | grep -oiE '[a-z][0-9]{2,3}' | head -1 | tr 'A-Z' 'a-z')
tag="$PRESET-$DTYPE-shape-${gpus}x$kind"
split_args="-sm layer${TS:+ --tensor-split $TS}" placements=${PLACEMENTS:-resident,streamed}

runner=multi-gpu-runs
source "$repo/tools/gpu/bench-run.sh"

gpu_tests() {  # the builds are there: build-and-test.sh only links them and runs pytest
    echo "multi-gpu-runs: tests on $gpus GPUs"
    timeout "${LIMIT_S:-240}" bash "$repo/tools/gpu/build-and-test.sh" -q -p no:cacheprovider -m gpu \
        tests/test_gpu_layer_split.py tests/test_gpu_equivalence.py > "$out/bench/tests.log" 2>&1
    tail -15 "$out/bench/tests.log"
}

mkdir -p "$out/bench"
echo "multi-gpu-runs: $gpus GPUs ($kind), $tag"
[ "$gpus" -ge 2 ] || echo "multi-gpu-runs: one GPU only: the split runs measure nothing a split does"
for r in ${RUNS:-tests split32k one32k}; do
    [ "$r" = tests ] && { gpu_tests; continue; }
    k=${r//[!0-9]/}  # the prompt's length in K tokens, from the run's name
    case "$r" in
        split[0-9]*k) bench_run "$r" TOKENS=$((k * 1024)) PLACEMENTS=$placements SERVER_ARGS="$split_args" \
                          VS_UPSTREAM=$([ "$k" -le 64 ] && echo 1 || echo 0) ;;
        one[0-9]*k)   bench_run "$r" TOKENS=$((k * 1024)) PLACEMENTS=$placements CUDA_VISIBLE_DEVICES=0 ;;
        *)            echo "multi-gpu-runs: unknown run '$r'" >&2 ;;
    esac
done
if [ -n "${OUT:-}" ]; then  # on the device: one file back instead of several per run
    tar -cJf "$OUT/multi-gpu.tar.xz" -C "$OUT" bench && rm -rf "$OUT/bench" && ls -la "$OUT/multi-gpu.tar.xz"
fi
