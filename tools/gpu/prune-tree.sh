#!/usr/bin/env bash
# Copy the pristine vendored tree without what a CPU/CUDA build of the libraries and tools never reads,
# so that it fits the GPU machine's transfer limit (64 MiB), and pack it (OUT.tar.xz, 7 MB, leaves a call room for
# a model piece): tools/gpu/prune-tree.sh OUT
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
src="$root/vendor/llama.cpp-upstream"
out=${1:-$root/.cache/device/llama.cpp}
[ -d "$src" ] || { echo "prune: $src missing: run make vendor" >&2; exit 1; }
rm -rf "$out.tmp" && mkdir -p "$out.tmp"
keep_backends='ggml-cpu|ggml-cuda|ggml-rpc'  # both builds configure GGML_RPC=ON
(cd "$src" && git archive --format=tar HEAD) | tar -x -C "$out.tmp" \
    --exclude='./docs' --exclude='docs/*' --exclude='media/*' --exclude='examples/*' --exclude='benches/*' \
    --exclude='tests/*' --exclude='tools/ui/src/*' --exclude='tools/ui/tests/*'
# models/: only the vocab files the random test models use
find "$out.tmp/models" -type f ! \( -name 'ggml-vocab-llama-bpe.gguf' -o -name 'ggml-vocab-qwen2.gguf' \
     -o -name 'ggml-vocab-qwen35.gguf' -o -name 'ggml-vocab-gemma-4.gguf' \) -delete
for d in "$out.tmp"/ggml/src/ggml-*/; do
    name=$(basename "$d"); [[ "$name" =~ ^($keep_backends)$ ]] || rm -rf "$d"
done
# CMake still lists the examples and tests folders; empty stubs keep it configuring
mkdir -p "$out.tmp/examples" "$out.tmp/tests"
rm -rf "$out" && mv "$out.tmp" "$out"
tar -cJf "$out.tar.xz.tmp" -C "$(dirname "$out")" "$(basename "$out")" && mv "$out.tar.xz.tmp" "$out.tar.xz"
du -sh "$out" "$out.tar.xz"
