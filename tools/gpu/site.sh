#!/usr/bin/env bash
# On the GPU machine: the carried wheels (.whl) into /tmp/site, once per machine, and the packed llama.cpp tree
# unpacked; scripts started side by side wait for each other instead of writing the same files at once.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
exec 9> /tmp/site.lock
flock 9
# the pruned tree may travel packed (7 MB against 50), leaving the call room for a model piece
tree="$repo/.cache/device/llama.cpp"
[ -d "$tree" ] || [ ! -f "$tree.tar.xz" ] || tar -xJf "$tree.tar.xz" -C "$(dirname "$tree")"
[ -f /tmp/site/.installed ] && exit 0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$repo"/.whl/*.whl
touch /tmp/site/.installed
