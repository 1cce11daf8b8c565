#!/usr/bin/env bash
# On the GPU machine after tools/gpu/prepare-8b.sh: mixed serving (issue 21, point 2). One long request arrives
# while C-1 users stream tokens, stock against RidgeFill in the same server, unified and separate KV; results in
# $OUT/serving.
#   TOKENS=32768,65536 USERS=2,4,8 [KV=unified,separate] [YIELD=50] [REPEATS=1] [SELECT=probe] \
#       bash tools/gpu/bench-serving-8b.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
export PYTHONPATH="/tmp/site:$repo" PYTHONUNBUFFERED=1
cd "$repo"
preset=${PRESET:-qwen3-8b} dtype=${DTYPE:-q8_0} split=${SPLIT:-13}
python3 - "$work/$preset-$dtype.gguf" "$work/$preset-$dtype.S$split.maps.gguf" "${OUT:-results}/serving" <<'PY'
import os, sys
from ridgefill_gguf.serving import run_serving
from ridgefill_gguf.random_gguf import ModelShape
env = os.environ.get
ints = lambda k, d: [int(x) for x in env(k, d).split(",") if x]
preset = env("PRESET", "qwen3-8b")
arch = ModelShape.from_gguf(sys.argv[1]).arch  # the override names the model's own key
r = run_serving(sys.argv[1], sys.argv[2], ints("TOKENS", "32768,65536"), ints("USERS", "2,4,8"),
                kv_modes=tuple(env("KV", "unified,separate").split(",")), yield_ms=tuple(ints("YIELD", "50")),
                reps=int(env("REPEATS", "1")), tail=int(env("TAIL", "4096")), select=env("SELECT", "probe"),
                n_gpu_layers=99, out_dir=sys.argv[3], label=env("LABEL", f"{preset}-{env('DTYPE', 'q8_0')}-h200"),
                extra=("--override-kv", f"{arch}.context_length=int:1048576"))
print(open(r["files"][1]).read())
PY
