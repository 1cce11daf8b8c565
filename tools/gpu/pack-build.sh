#!/usr/bin/env bash
# On the GPU machine: a finished CUDA build's bin/ packed under $OUT in pieces the device tool brings back
# (16 MiB each). Put them in .cache/device/ here and carry them: build-and-test.sh unpacks them on a fresh
# machine and skips that build while the patch series is the same.
#   bash tools/gpu/pack-build.sh [ridgefill|upstream]
set -euo pipefail
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
t=${1:-ridgefill}
[ -f "$work/out-$t/.ridgefill-state" ] || { echo "pack: no finished $t build under $work" >&2; exit 1; }
tar -cf - -C "$work" "out-$t" | xz -T0 -6 | split -b 15M - "${OUT:?}/out-$t.tar.xz.part"
ls -la "$OUT"/out-"$t".tar.xz.part*
