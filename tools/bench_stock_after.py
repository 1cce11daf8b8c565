#!/usr/bin/env python3
"""Does a RidgeFill request slow the stock requests after it? A diagnostic for issue 7.

  python tools/bench_stock_after.py MODEL.gguf MAPS.gguf --tokens 32768 [--small 8192] [-ngl 99] [--no-graphs]

On the H200 (2026-12-01) the exact arm, stock requests between RidgeFill requests on one server, took 6-9% longer
than the upstream build's stock prefill and than the same server's own stock warm-up, the one stock request before
any RidgeFill request. This script runs, on one server with the maps attached:

  fresh        stock x R, before any RidgeFill request
  after-small  one RidgeFill request of --small tokens (small graphs, a small compute buffer), then stock x R
  after-full   one RidgeFill request of --tokens tokens, then stock x R
  after-idle   --idle seconds with the GPU idle, then stock x R

and records each request's prompt time with the GPU's mean SM clock, power and temperature while it ran. If the
slowdown survives the idle pause, it is state the RidgeFill request left (the scheduler's compute buffer, the CUDA
memory pool, CUDA graphs); if it goes away, it is the GPU's clocks. --no-graphs runs the same on a second server
with GGML_CUDA_DISABLE_GRAPHS=1. JSON and Markdown under --results.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ridgefill_gguf.bench import DeviceMemory, default_text, markdown_table  # noqa: E402
from ridgefill_gguf.serve import Server  # noqa: E402
from ridgefill_gguf.util import hardware, write_atomic  # noqa: E402

MONITOR = ("clocks.sm", "power.draw", "temperature.gpu")


def run_sequence(srv: Server, mon: DeviceMemory, tokens: list[int], n: int, small: int, repeats: int,
                 idle: float) -> list[dict]:
    out = []

    def request(phase: str, n_tokens: int, ridgefill: bool) -> None:
        t0 = time.monotonic()
        t = srv.complete(tokens[:n_tokens], n_predict=1, ridgefill=ridgefill)["timings"]
        if ridgefill and "ridgefill" not in t:
            raise RuntimeError(f"{n_tokens} tokens: RidgeFill did not run (see {srv.log_path})")
        gpu = mon.means(t0, time.monotonic()) or {}
        out.append({"phase": phase, "tokens": n_tokens, "ridgefill": ridgefill, "prompt_ms": t["prompt_ms"],
                    **{k: round(v, 1) for k, v in gpu.items()}})
        print(f"{phase:12s} {'RidgeFill' if ridgefill else 'stock':9s} {n_tokens:6d} tokens {t['prompt_ms']:8.0f} ms "
              + " ".join(f"{k} {v:.0f}" for k, v in gpu.items()), flush=True)

    srv.complete(tokens[:small], n_predict=1, ridgefill=False)  # warm-up, stock only
    for _ in range(repeats):
        request("fresh", n, False)
    request("after-small", small, True)
    for _ in range(repeats):
        request("after-small", n, False)
    request("after-full", n, True)
    for _ in range(repeats):
        request("after-full", n, False)
    time.sleep(idle)
    for _ in range(repeats):
        request("after-idle", n, False)
    return out


def summary(requests: list[dict]) -> dict[str, float]:
    """The median stock prompt time of each phase."""
    phases = dict.fromkeys(r["phase"] for r in requests)
    return {p: statistics.median(r["prompt_ms"] for r in requests if r["phase"] == p and not r["ridgefill"])
            for p in phases}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("maps", type=Path)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--small", type=int, default=8192, help="the small RidgeFill request's tokens (above the tail)")
    ap.add_argument("--tail", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--idle", type=float, default=20.0, help="seconds of idle GPU before the last phase")
    ap.add_argument("--no-graphs", action="store_true", help="also a server with GGML_CUDA_DISABLE_GRAPHS=1")
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=None)
    ap.add_argument("--min-prefix", type=int, default=None)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--extra", default="", help="more llama-server arguments, one string")
    ap.add_argument("--results", type=Path, default=ROOT / "results" / "bench")
    ap.add_argument("--label", default=None)
    args = ap.parse_args()
    if not args.tail < args.small <= args.tokens:
        raise SystemExit("need --tail < --small <= --tokens")
    text = default_text(6 * args.tokens)
    common = dict(n_ctx=args.tokens + 64, n_gpu_layers=args.n_gpu_layers, threads=args.threads, tail=args.tail,
                  min_prefix=args.min_prefix, extra=tuple(shlex.split(args.extra)))
    variants = {"default": None, **({"no-cuda-graphs": {"GGML_CUDA_DISABLE_GRAPHS": "1"}} if args.no_graphs else {})}
    args.results.mkdir(parents=True, exist_ok=True)
    stem = f"{dt.date.today().isoformat()}-stock-after-ridgefill-{args.label or args.model.stem}"
    result = {"benchmark": "stock prefill before and after a RidgeFill request, one server",
              "date": dt.date.today().isoformat(), "hardware": hardware(), "command": " ".join(sys.argv),
              "tokens": args.tokens, "small": args.small, "idle_s": args.idle, "variants": {}}
    with DeviceMemory(fields=MONITOR) as mon:
        for name, env in variants.items():
            with Server(args.model, args.maps, env=env, log_path=args.results / f"{stem}-{name}.server.log",
                        **common) as srv:
                tokens = srv.post("/tokenize", {"content": text, "add_special": True})["tokens"]
                if len(tokens) < args.tokens:
                    raise SystemExit(f"the text gives {len(tokens)} tokens, fewer than {args.tokens}")
                requests = run_sequence(srv, mon, tokens, args.tokens, args.small, args.repeats, args.idle)
            result["variants"][name] = {"environment": env or {}, "requests": requests, "median_ms": summary(requests)}
            write_atomic(args.results / f"{stem}.json", json.dumps(result, indent=2) + "\n")
    phases = ("after-small", "after-full", "after-idle")
    md = [f"# Stock prefill before and after a RidgeFill request: {args.model.name}, {args.tokens} tokens", "",
          f"{result['date']}; {result['hardware'].get('gpu') or result['hardware']['cpu']}; `{result['command']}`"]
    medians = markdown_table(
        "Median stock prompt time per phase (ms) and its ratio to `fresh` (before any RidgeFill request):",
        ["server", "fresh", "after a small RidgeFill request", "after a full one", "after an idle pause"],
        [[name, f"{v['median_ms']['fresh']:.0f}",
          *(f"{v['median_ms'][p]:.0f} ({v['median_ms'][p] / v['median_ms']['fresh']:.3f})" for p in phases)]
         for name, v in result["variants"].items()])
    md += medians + markdown_table(
        "Every request, with the GPU's means while it ran:",
        ["server", "phase", "request", "tokens", "prompt (ms)", *MONITOR],
        [[name, r["phase"], "RidgeFill" if r["ridgefill"] else "stock", r["tokens"], f"{r['prompt_ms']:.0f}",
          *(r.get(k, "n/a") for k in MONITOR)] for name, v in result["variants"].items() for r in v["requests"]])
    write_atomic(args.results / f"{stem}.md", "\n".join(md) + "\n")
    print("\n".join(medians))
    return 0


if __name__ == "__main__":
    sys.exit(main())
