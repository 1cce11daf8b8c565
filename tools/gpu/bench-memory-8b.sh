#!/usr/bin/env bash
# On the GPU machine after tools/gpu/prepare-8b.sh (both trees): device memory and prompt time of a long prompt,
# upstream's server against the patched one with the maps resident and streamed, one server at a time.
# Results in $OUT/bench.
#   TOKENS=32768,131072 [PLACEMENTS=resident,streamed] [TAIL=4096] [BASELINE=upstream|no-maps] [LABEL=...] \
#       bash tools/gpu/bench-memory-8b.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
export PYTHONPATH="/tmp/site:$repo" PYTHONUNBUFFERED=1 LD_PRELOAD=${LD_PRELOAD:-/lib/x86_64-linux-gnu/libstdc++.so.6}
cd "$repo"
preset=${PRESET:-qwen3-8b} dtype=${DTYPE:-q8_0} split=${SPLIT:-13}  # as tools/gpu/prepare-8b.sh made them
python3 - "$work/$preset-$dtype.gguf" "$work/$preset-$dtype.S$split.maps.gguf" "${OUT:-results}/bench" <<'PY'
import os, sys
from ridgefill_gguf.bench_memory import run_memory_bench
from ridgefill_gguf.random_gguf import ModelShape
preset = os.environ.get("PRESET", "qwen3-8b")
arch = ModelShape.from_gguf(sys.argv[1]).arch  # the override names the model's own key
r = run_memory_bench(sys.argv[1], sys.argv[2], [int(x) for x in os.environ.get("TOKENS", "32768,131072").split(",")],
                     tail=int(os.environ.get("TAIL", "4096")),
                     placements=tuple(os.environ.get("PLACEMENTS", "resident,streamed").split(",")),
                     out_dir=sys.argv[3], baseline=os.environ.get("BASELINE", "upstream"), label=os.environ.get("LABEL", f"{preset}-{os.environ.get('DTYPE', 'q8_0')}-shape-h200"),
                     # the random model says 40,960 tokens like Qwen3-8B; 128K prompts need room above 131,072
                     extra=("--override-kv", f"{arch}.context_length=int:262144"))
print(open(r["files"][1]).read())
PY
