#!/usr/bin/env bash
# On the GPU machine after tools/gpu/prepare-8b.sh: the cost of carrying RidgeFill when it is off (issue 7):
# the upstream llama-server against the patched one with maps attached and every request ridgefill=false,
# both servers up at once, requests alternating. Results in $OUT/bench.   TOKENS=32768 bash tools/gpu/bench-off-8b.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
export PYTHONPATH="/tmp/site:$repo" PYTHONUNBUFFERED=1
cd "$repo"
python3 - "$work/qwen3-8b-q8_0.gguf" "$work/qwen3-8b-q8_0.S13.maps.gguf" "${OUT:-results}/bench" <<'PY'
import json, os, statistics, sys
from pathlib import Path
from ridgefill_gguf.serve import Server
from ridgefill_gguf.bench import default_text
from ridgefill_gguf.util import hardware
model, maps, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
n = int(os.environ.get("TOKENS", "32768")); repeats = int(os.environ.get("REPEATS", "5"))
extra = ("--override-kv", "qwen3.context_length=int:131072")
kw = dict(n_ctx=n + 64, n_gpu_layers=99, extra=extra)
with Server(model, build="upstream", log_path=out / "server-upstream.log", **kw) as up, \
     Server(model, maps, build="ridgefill", log_path=out / "server-off.log", **kw) as rf:
    prompt = up.post("/tokenize", {"content": default_text(6 * n), "add_special": True})["tokens"][:n]
    up.complete(prompt, n_predict=1); rf.complete(prompt, n_predict=1, ridgefill=False)
    a, b = [], []
    for i in range(repeats):
        a.append(up.complete(prompt, n_predict=1)["timings"]["prompt_ms"])
        t = rf.complete(prompt, n_predict=1, ridgefill=False)["timings"]
        assert "ridgefill" not in t
        b.append(t["prompt_ms"])
        print(f"off: run {i + 1}: upstream {a[-1]:.0f} ms, patched with maps attached, off {b[-1]:.0f} ms")
r = {"benchmark": "attached but off vs upstream", "tokens": n, "hardware": hardware(), "upstream_ms": a,
     "off_ms": b, "median_upstream": statistics.median(a), "median_off": statistics.median(b),
     "off_over_upstream": statistics.median(b) / statistics.median(a)}
(out / "off-vs-upstream.json").write_text(json.dumps(r, indent=2))
print(json.dumps({k: v for k, v in r.items() if k != "hardware"}))
PY
