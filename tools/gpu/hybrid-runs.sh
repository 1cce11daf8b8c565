#!/usr/bin/env bash
# On the GPU machine, after tools/gpu/prepare-8b.sh (PRESET=qwen35-27b DTYPE=q8_0 SPLIT=16): the hybrid runs issue 20
# still needs, each under its own time limit so that one that stalls leaves the others their time. Each run's
# results and server log go to $OUT/bench, packed at the end into one $OUT/hybrid-runs.tar.xz (the device tool
# brings back at most 8 files).
#   RUNS="probe128k recurrent32k chunk512 chunk8192 streamed64k fused32k chunked32k blocked16k blocked32k blocked64k \
#         streamed128k upstream32k" [LIMIT_S=240] \
#       bash tools/gpu/hybrid-runs.sh
# (fused/chunked/blocked: the carry's state update, --ridgefill-state-update; upstream32k needs the upstream build and no
# SERVER_ARGS, which the upstream server would refuse)
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out="${OUT:-$repo/results}"
export PRESET=${PRESET:-qwen35-27b} DTYPE=${DTYPE:-q8_0} SPLIT=${SPLIT:-16} REPEATS=${REPEATS:-1}
export STATE_US=${STATE_US:-1.24} SELECT=${SELECT:-probe}
tag="$PRESET-$DTYPE-shape-h200"

runner=hybrid-runs
source "$repo/tools/gpu/bench-run.sh"

mkdir -p "$out/bench"
for r in ${RUNS:-probe128k recurrent32k chunk512}; do
    case "$r" in
        probe128k)    bench_run "$r" TOKENS=131072 PLACEMENTS=resident ;;
        recurrent32k) bench_run "$r" TOKENS=32768 PLACEMENTS=resident ;;
        chunk512)     bench_run "$r" TOKENS=32768 PLACEMENTS=resident SERVER_ARGS="--ridgefill-recurrent-chunk 512" ;;
        chunk8192)    bench_run "$r" TOKENS=32768 PLACEMENTS=resident SERVER_ARGS="--ridgefill-recurrent-chunk 8192" ;;
        streamed64k)  bench_run "$r" TOKENS=65536 PLACEMENTS=streamed ;;
        fused32k)     bench_run "$r" TOKENS=32768 PLACEMENTS=resident SERVER_ARGS="--ridgefill-state-update fused" ;;
        blocked32k)   bench_run "$r" TOKENS=32768 PLACEMENTS=resident SERVER_ARGS="--ridgefill-state-update blocked" ;;
        blocked64k)   bench_run "$r" TOKENS=65536 PLACEMENTS=resident SERVER_ARGS="--ridgefill-state-update blocked" ;;
        blocked16k)   bench_run "$r" TOKENS=16384 PLACEMENTS=resident SERVER_ARGS="--ridgefill-state-update blocked" ;;
        streamed128k) bench_run "$r" TOKENS=131072 PLACEMENTS=streamed ;;
        chunked32k)   bench_run "$r" TOKENS=32768 PLACEMENTS=resident SERVER_ARGS="--ridgefill-state-update chunked" ;;
        upstream32k)  bench_run "$r" TOKENS=32768 PLACEMENTS=resident VS_UPSTREAM=1 ;;
        *)            echo "hybrid-runs: unknown run '$r'" >&2 ;;
    esac
done
if [ -n "${OUT:-}" ]; then  # on the device: one file back instead of four per run
    tar -cJf "$OUT/hybrid-runs.tar.xz" -C "$OUT" bench && rm -rf "$OUT/bench" && ls -la "$OUT/hybrid-runs.tar.xz"
fi
