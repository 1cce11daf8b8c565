#!/usr/bin/env bash
# On the GPU machine (device tool): build the patched and the upstream llama.cpp with CUDA outside the repo,
# so a warm machine reuses them, then run the tests there. Carry: .cache/device/llama.cpp.tar.xz (or the
# unpacked .cache/device/llama.cpp, 50 MB against the packed 7 MB), .whl
#   bash tools/gpu/build-and-test.sh [--build-only] [pytest args...]
#
# One source tree and one build folder serve both builds: the patched tree is built first, its outputs are
# copied aside, then the patches are reversed and the same folder rebuilt. The only ggml source a patch touches is
# ggml-cuda's gated_delta_net.cu (the blocked state update), so the second build recompiles that file, llama,
# common and the tools (about 2 minutes instead of a second 6-minute CUDA build).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
mkdir -p "$work"

# the Python side: carried wheels (gguf, llama-cpp-python bindings, diskcache) and this checkout; the packed tree
bash "$repo/tools/gpu/site.sh"
tree="$repo/.cache/device/llama.cpp"
[ -d "$tree" ] || { echo "gpu: carry .cache/device/llama.cpp.tar.xz (tools/gpu/prune-tree.sh makes it)" >&2; exit 1; }
export PYTHONPATH="/tmp/site:$repo" PYTHONUNBUFFERED=1

series=$(cat "$repo"/patches/*.patch | sha256sum | cut -c1-16)
src="$work/src" state="$work/src/.ridgefill-state"   # state: "upstream" or the applied series
[ -d "$src" ] || { cp -a "$tree" "$src" && echo upstream > "$state"; }

to_upstream() {
    local applied; applied=$(cat "$state")
    [ "$applied" = upstream ] && return
    # reverse the series that is applied (saved beside it), last patch first
    for p in $(ls "$work/applied-patches"/*.patch | sort -r); do
        (cd "$src" && patch -p1 -R -s < "$p") || { echo "gpu: cannot reverse $(basename "$p")" >&2; exit 1; }
    done
    echo upstream > "$state"
}
to_ridgefill() {
    [ "$(cat "$state")" = "$series" ] && return
    to_upstream
    for p in "$repo"/patches/*.patch; do
        (cd "$src" && patch -p1 -s --forward < "$p") || { echo "gpu: patch $(basename "$p") does not apply" >&2; exit 1; }
    done
    rm -rf "$work/applied-patches" && cp -a "$repo/patches" "$work/applied-patches"
    echo "$series" > "$state"
}

export JOBS=${JOBS:-16} RIDGEFILL_CUDA=1 CUDA_ARCH=${CUDA_ARCH:-90}
# $ORIGIN run paths: each build's copied bin/ loads its own libllama
export EXTRA_CMAKE_ARGS="-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON ${EXTRA_CMAKE_ARGS:-}"
t0=$(date +%s)
# a build an earlier call packed (tools/gpu/pack-build.sh) and this one carried: used below if its series matches
for t in ridgefill upstream; do
    parts=("$repo/.cache/device/out-$t.tar.xz.part"*)
    [ -e "${parts[0]}" ] && [ ! -d "$work/out-$t" ] && cat "${parts[@]}" | xz -d | tar -x -C "$work"
done
for t in ${RIDGEFILL_GPU_TREES:-ridgefill upstream}; do
    want=$([ "$t" = upstream ] && echo upstream || echo "$series")
    out="$work/out-$t"
    [ "$(cat "$out/.ridgefill-state" 2>/dev/null)" = "$want" ] && continue
    "to_$t"
    "$repo/tools/build.sh" "$src" "$work/build" > "$work/build-$t.log" 2>&1 || { tail -30 "$work/build-$t.log"; exit 1; }
    rm -rf "$out.tmp" && mkdir -p "$out.tmp" && cp -a "$work/build/bin" "$work/build/CMakeCache.txt" "$out.tmp/"
    echo "$want" > "$out.tmp/.ridgefill-state"
    rm -rf "$out" && mv "$out.tmp" "$out"
    echo "gpu: $t build ready after $(( $(date +%s) - t0 )) s"
done
mkdir -p "$repo/build" "$repo/vendor"
for t in upstream ridgefill; do [ -d "$work/out-$t" ] && ln -sfn "$work/out-$t" "$repo/build/$t"; done
ln -sfn "$tree" "$repo/vendor/llama.cpp"  # the vocab files of the random test models
# this image's python resolves some libstdc++ symbols of libggml-cuda wrongly (a segfault in
# llama_model::print_info under ctypes); loading the system libstdc++ first avoids it
export LD_PRELOAD=${LD_PRELOAD:-/lib/x86_64-linux-gnu/libstdc++.so.6}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
[ "${1:-}" = --build-only ] && exit 0
cd "$repo" && python3 -m pytest "$@"
