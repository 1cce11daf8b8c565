#!/usr/bin/env bash
# Configure (once) and build one llama.cpp tree: the shared libllama/ggml libraries,
# llama-server, llama-cli, llama-perplexity and ggml-rpc-server. CUDA when nvcc and a GPU are present.
#   tools/build.sh SOURCE_DIR BUILD_DIR
# Environment: CUDA_ARCH (default 90), RIDGEFILL_CUDA=0|1 (default: auto), TARGETS (default: the list below),
#              JOBS (default: nproc), EXTRA_CMAKE_ARGS.
set -euo pipefail
src=${1:?usage: tools/build.sh SOURCE_DIR BUILD_DIR}
out=${2:?usage: tools/build.sh SOURCE_DIR BUILD_DIR}
[ -f "$src/CMakeLists.txt" ] || { echo "build: $src is not a llama.cpp tree; run 'make vendor' (and 'make patch') first" >&2; exit 1; }

root=$(cd "$(dirname "$0")/.." && pwd)
jobs=${JOBS:-$(nproc)}

cuda=${RIDGEFILL_CUDA:-auto}
if [ "$cuda" = auto ]; then
    cuda=0
    if command -v nvcc >/dev/null 2>&1 && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then cuda=1; fi
fi

args=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
      -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
      -DGGML_BACKEND_DL=OFF -DGGML_RPC=ON)  # RPC: layer splits over rpc-server hosts (tests start them on 127.0.0.1)
if [ "$cuda" = 1 ]; then
    args+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}")
elif grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    # -march=native turns on llama.cpp's AMX kernels where the CPU reports AMX, and they fault (SIGILL/SIGSEGV)
    # under kernels that do not grant the tile state, as on sandboxed machines; explicit -mno-* outrank -march
    amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    args+=("-DCMAKE_C_FLAGS=$amx" "-DCMAKE_CXX_FLAGS=$amx")
fi
if command -v ccache >/dev/null 2>&1; then
    args+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    [ "$cuda" = 1 ] && args+=(-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
    # relative paths in the cache key: a fresh clone elsewhere (CI) still hits the cache
    export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1 CCACHE_SLOPPINESS=time_macros
fi
# shellcheck disable=SC2206
args+=(${EXTRA_CMAKE_ARGS:-})

mkdir -p "$out"
stamp="$out/.ridgefill-configure"
want="$(printf '%s\n' "${args[@]}")"
if [ ! -f "$out/CMakeCache.txt" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "build: configuring $out (cuda=$cuda)"
    cmake -S "$src" -B "$out" "${args[@]}" >"$out/configure.log" 2>&1 || { tail -40 "$out/configure.log" >&2; exit 1; }
    printf '%s' "$want" >"$stamp"
fi
echo "build: $out ($jobs jobs)"
# shellcheck disable=SC2086
cmake --build "$out" -j "$jobs" --target ${TARGETS:-llama ggml llama-server llama-cli llama-perplexity ggml-rpc-server}
