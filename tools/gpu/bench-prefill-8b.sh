#!/usr/bin/env bash
# On the GPU machine after tools/gpu/prepare-8b.sh: time to first token, exact against RidgeFill, for the
# random model PRESET makes (default Qwen3-8B-shaped, split 13), tail TAIL (4096), resident and streamed (issue 5).
# Results in $OUT/bench.
#   TOKENS=16384,32768,65536 [PLACEMENTS=resident,streamed] [UBATCH=512] [VS_UPSTREAM=1] [LABEL=...] \
#       [SELECT=probe,random] [EXACT_SHARES=0.1,0.2,0.3] [STATE_US=1.24] bash tools/gpu/bench-prefill-8b.sh
# STATE_US: a hybrid's state update per row and layer (tools/gpu/bench-gdn.sh), for the ceilings that time it.
# SERVER_ARGS: more llama-server flags, e.g. "--ridgefill-recurrent-chunk 512".
# SWA_FULL=0: a windowed model's servers keep one window of cells (llama-server's default), not every row.
# SELECT and EXACT_SHARES: issue 8's cost (the selectors beside plain RidgeFill; the line tau(E) and kappa);
# SELECT=probe,probe@1.5,probe@2 times the probe at those budget factors too (issue 22's sweep, speed side).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
export PYTHONPATH="/tmp/site:$repo" PYTHONUNBUFFERED=1 LD_PRELOAD=${LD_PRELOAD:-/lib/x86_64-linux-gnu/libstdc++.so.6}
cd "$repo"
preset=${PRESET:-qwen3-8b} dtype=${DTYPE:-q8_0} split=${SPLIT:-13}  # as tools/gpu/prepare-8b.sh made them
python3 - "$work/$preset-$dtype.gguf" "$work/$preset-$dtype.S$split.maps.gguf" "${OUT:-results}/bench" <<'PY'
import sys
from ridgefill_gguf.bench import run_bench
from ridgefill_gguf.random_gguf import ModelShape
import os
lengths = [int(x) for x in os.environ.get("TOKENS", "16384,32768,65536").split(",")]
ub = os.environ.get("UBATCH")
preset = os.environ.get("PRESET", "qwen3-8b")
arch = ModelShape.from_gguf(sys.argv[1]).arch
r = run_bench(sys.argv[1], sys.argv[2], lengths, tail=int(os.environ.get("TAIL", "4096")),
              placements=tuple(os.environ.get("PLACEMENTS", "resident,streamed").split(",")),
              repeats=int(os.environ.get("REPEATS", "3")), n_gpu_layers=99, out_dir=sys.argv[3],
              label=os.environ.get("LABEL", f"{os.environ.get('PRESET', 'qwen3-8b')}-{os.environ.get('DTYPE', 'q8_0')}-shape-h200"), vs_upstream=os.environ.get("VS_UPSTREAM") == "1",
              selectors=tuple(x for x in os.environ.get("SELECT", "").split(",") if x),
              exact_shares=tuple(float(x) for x in os.environ.get("EXACT_SHARES", "").split(",") if x),
              state_update_us=float(os.environ["STATE_US"]) if os.environ.get("STATE_US") else None,
              swa_full=os.environ.get("SWA_FULL") != "0",
              # the random model says 40,960 tokens like Qwen3-8B; speed does not depend on it, and 128K prompts need
              # room for the generated token above 131,072
              extra=("--override-kv", f"{arch}.context_length=int:262144") + (("-b", ub, "-ub", ub) if ub else ())
                    + tuple(os.environ.get("SERVER_ARGS", "").split()))
print(open(r["files"][1]).read())
PY
