#!/usr/bin/env bash
# On the GPU machine (device tool): build upstream and patched llama.cpp with CUDA outside the repo,
# so a warm machine reuses the builds, then run the tests there. Carry: .cache/device/llama.cpp, .whl
#   bash tools/gpu/build-and-test.sh [--build-only] [pytest args...]
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
tree="$repo/.cache/device/llama.cpp"
[ -d "$tree" ] || { echo "gpu: carry .cache/device/llama.cpp (tools/gpu/prune-tree.sh makes it)" >&2; exit 1; }
mkdir -p "$work"

# the Python side: carried wheels (gguf, llama-cpp-python bindings, diskcache) and this checkout
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$repo"/.whl/*.whl
export PYTHONPATH="/tmp/site:$repo" PYTHONUNBUFFERED=1

series=$(cat "$repo"/patches/*.patch | sha256sum | cut -c1-16)
if [ ! -d "$work/src-upstream" ]; then cp -a "$tree" "$work/src-upstream"; fi
if [ "$(cat "$work/src-ridgefill/.series" 2>/dev/null)" != "$series" ]; then
    rm -rf "$work/src-ridgefill" && cp -a "$tree" "$work/src-ridgefill"
    for p in "$repo"/patches/*.patch; do
        (cd "$work/src-ridgefill" && patch -p1 -s --forward < "$p") || { echo "gpu: patch $(basename "$p") does not apply" >&2; exit 1; }
    done
    echo "$series" > "$work/src-ridgefill/.series"
fi
export JOBS=${JOBS:-16} RIDGEFILL_CUDA=1 CUDA_ARCH=${CUDA_ARCH:-90}
t0=$(date +%s)
# RIDGEFILL_GPU_TREES=ridgefill builds the patched tree only (a cold CUDA build takes ~6.5 min per tree)
for t in ${RIDGEFILL_GPU_TREES:-upstream ridgefill}; do
    "$repo/tools/build.sh" "$work/src-$t" "$work/build-$t" > "$work/build-$t.log" 2>&1 || { tail -30 "$work/build-$t.log"; exit 1; }
done
echo "gpu: builds ready in $(( $(date +%s) - t0 )) s"
mkdir -p "$repo/build" "$repo/vendor"
ln -sfn "$work/build-upstream" "$repo/build/upstream"
ln -sfn "$work/build-ridgefill" "$repo/build/ridgefill"
ln -sfn "$work/src-upstream" "$repo/vendor/llama.cpp"  # the vocab files of the random test models
# this image's python resolves some libstdc++ symbols of libggml-cuda wrongly (a segfault in
# llama_model::print_info under ctypes); loading the system libstdc++ first avoids it
export LD_PRELOAD=${LD_PRELOAD:-/lib/x86_64-linux-gnu/libstdc++.so.6}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
[ "${1:-}" = --build-only ] && exit 0
cd "$repo" && python3 -m pytest "$@"
