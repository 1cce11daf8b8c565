#!/usr/bin/env bash
# On the GPU machine after tools/gpu/prepare-8b.sh: one RidgeFill request with the probe at TOKENS, nothing before
# it, the server's progress lines in its log; while it runs, the GPU's load and the server's CPU time every 5 s; at
# LIMIT_S a backtrace of every server thread (cuda-gdb attaches: there is no gdb) before the server is stopped.
# It says which stage of a slow prefill takes the time, and whether the GPU or the host is busy meanwhile.
#   [MODEL=... MAPS=...] TOKENS=131072 [LIMIT_S=200] [SERVER_ARGS=...] bash tools/gpu/probe-once.sh
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
export PYTHONPATH="/tmp/site:$repo" PYTHONUNBUFFERED=1 LD_PRELOAD=${LD_PRELOAD:-/lib/x86_64-linux-gnu/libstdc++.so.6}
preset=${PRESET:-qwen35-27b} dtype=${DTYPE:-q8_0} split=${SPLIT:-16}
export MODEL=${MODEL:-$work/$preset-$dtype.gguf} MAPS=${MAPS:-$work/$preset-$dtype.S$split.maps.gguf}
out="${OUT:-$repo/results}/bench"
mkdir -p "$out"
cd "$repo"
python3 - "$out" <<'PY'
import json, os, subprocess, sys, threading, time
from pathlib import Path
from ridgefill_gguf.serve import Server
from ridgefill_gguf.bench import default_text
from ridgefill_gguf.random_gguf import ModelShape

out, n = Path(sys.argv[1]), int(os.environ.get("TOKENS", "131072"))
limit = float(os.environ.get("LIMIT_S", "200"))
label = os.environ.get("LABEL", f"probe-once-{n}")
arch = ModelShape.from_gguf(os.environ["MODEL"]).arch
extra = ("--override-kv", f"{arch}.context_length=int:262144", *os.environ.get("SERVER_ARGS", "").split())
samples, result = [], {"tokens": n, "limit_s": limit}

def gpu():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi: {e}"

def cpu_s(pid):  # user + system seconds of the whole process
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

with Server(os.environ["MODEL"], os.environ["MAPS"], tail=int(os.environ.get("TAIL", "4096")), n_ctx=n + 64,
            n_gpu_layers=99, extra=extra, log_path=out / f"{label}-server.log") as srv:
    result["command"] = " ".join(srv.command)
    tokens = srv.post("/tokenize", {"content": default_text(6 * n), "add_special": True})["tokens"][:n]
    for sel in os.environ.get("PRE", "").split(","):  # requests before the measured one, e.g. PRE=stock,none
        if sel:
            r = (srv.complete(tokens, n_predict=1, ridgefill=False) if sel == "stock" else
                 srv.complete(tokens, n_predict=1, ridgefill=True, ridgefill_select=sel))
            result.setdefault("pre", []).append({"select": sel, "prompt_ms": r["timings"]["prompt_ms"]})
            print("probe-once: before it,", result["pre"][-1], flush=True)
    done = threading.Event()
    def request():
        try:
            r = srv.complete(tokens, n_predict=1, ridgefill=True, ridgefill_select="probe")
            result["timings"] = r.get("timings")
        except Exception as e:  # noqa: BLE001 - recorded, the sampler still reports
            result["error"] = repr(e)
        done.set()
    t0 = time.monotonic()
    threading.Thread(target=request, daemon=True).start()
    while not done.wait(5) and time.monotonic() - t0 < limit:
        samples.append({"t_s": round(time.monotonic() - t0, 1), "gpu": gpu(), "server_cpu_s": cpu_s(srv.proc.pid)})
        print("probe-once:", samples[-1], flush=True)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    if not done.is_set():
        result["stalled"] = True
        bt = subprocess.run(["cuda-gdb", "-p", str(srv.proc.pid), "-batch", "-ex", "thread apply all bt 30"],
                            capture_output=True, text=True, timeout=120)
        (out / f"{label}-backtrace.txt").write_text(bt.stdout + bt.stderr)
result["samples"] = samples
(out / f"{label}.json").write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
PY
grep -a "RidgeFill" "$out/${LABEL:-probe-once-${TOKENS:-131072}}-server.log" | tail -40
