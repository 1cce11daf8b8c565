#!/usr/bin/env bash
# On the GPU machine: the carried wheels (.whl) into /tmp/site, once per machine; scripts started side by side
# wait for each other instead of writing the same files at once.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
exec 9> /tmp/site.lock
flock 9
[ -f /tmp/site/.installed ] && exit 0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$repo"/.whl/*.whl
touch /tmp/site/.installed
