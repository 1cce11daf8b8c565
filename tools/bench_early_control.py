#!/usr/bin/env python3
"""Where does sweep one's extra time come from? A control for docs/gpu.md's question (issue 7).

  python tools/bench_early_control.py MODEL.gguf MAPS.gguf MODEL_FIRST_S_LAYERS.gguf --tokens 16384,32768 [-ngl 99]

MODEL_FIRST_S_LAYERS is the same random model cut to its first S layers (`python -m ridgefill_gguf.random_gguf
--preset ... --layers S`: the same seed gives the same weights for those layers). One server runs MODEL with the
maps: RidgeFill's sweep one (timings.ridgefill.early_ms) and the stock prefill. Another runs the S-layer model
stock. If the S-layer stock prefill takes about as long as sweep one, the excess over S/L of the full stock
prefill is a cost llama.cpp pays per row and cell whatever the layer count (the KQ mask, per-ubatch work); if it
takes about S/L of the full one, RidgeFill's early graphs are the slower part. Medians of --repeats requests
each; JSON and Markdown under results/bench/.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ridgefill_gguf.bench import default_text  # noqa: E402
from ridgefill_gguf.gguf_io import read_gguf  # noqa: E402
from ridgefill_gguf.random_gguf import ModelShape  # noqa: E402
from ridgefill_gguf.serve import Server  # noqa: E402
from ridgefill_gguf.util import hardware, write_atomic  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("maps", type=Path)
    ap.add_argument("early_model", type=Path, help="the model cut to its first S layers")
    ap.add_argument("--tokens", default="16384,32768")
    ap.add_argument("--tail", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=None)
    ap.add_argument("--min-prefix", type=int, default=None)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--extra", default="", help="more llama-server arguments, one string (--extra='-ub 2048')")
    ap.add_argument("--results", type=Path, default=ROOT / "results" / "bench")
    args = ap.parse_args()
    lengths = [int(x) for x in args.tokens.split(",")]
    split = int(read_gguf(args.maps).get("ridgefill.split"))
    n_layer = ModelShape.from_gguf(args.model).n_layer
    if ModelShape.from_gguf(args.early_model).n_layer != split:
        raise SystemExit(f"{args.early_model} must have the split's {split} layers")
    text = default_text(6 * max(lengths))
    common = dict(n_ctx=max(lengths) + 64, n_gpu_layers=args.n_gpu_layers, threads=args.threads,
                  extra=tuple(shlex.split(args.extra)))
    rows = {n: {} for n in lengths}

    def med(xs):
        return statistics.median(xs)

    with Server(args.model, args.maps, tail=args.tail, min_prefix=args.min_prefix, **common) as srv:
        tokens = srv.post("/tokenize", {"content": text, "add_special": True})["tokens"]
        srv.complete(tokens[:lengths[0]], n_predict=1, ridgefill=False)
        srv.complete(tokens[:lengths[0]], n_predict=1, ridgefill=True)
        for n in lengths:
            stock, early = [], []
            for _ in range(args.repeats):
                stock.append(srv.complete(tokens[:n], n_predict=1, ridgefill=False)["timings"]["prompt_ms"])
                early.append(srv.complete(tokens[:n], n_predict=1, ridgefill=True)["timings"]["ridgefill"]["early_ms"])
            rows[n].update(stock_full_ms=med(stock), sweep_one_ms=med(early))
    with Server(args.early_model, None, **common) as srv:
        srv.complete(tokens[:lengths[0]], n_predict=1)
        for n in lengths:
            rows[n]["stock_first_layers_ms"] = med([srv.complete(tokens[:n], n_predict=1)["timings"]["prompt_ms"]
                                                    for _ in range(args.repeats)])
    for n, r in rows.items():
        r["share_of_full"] = split / n_layer * r["stock_full_ms"]
        print(f"{n} tokens: sweep one {r['sweep_one_ms']:.0f} ms, stock of the first {split} layers "
              f"{r['stock_first_layers_ms']:.0f} ms, {split}/{n_layer} of the full stock {r['share_of_full']:.0f} ms")
    result = {"benchmark": "sweep one against a stock prefill of the first S layers", "date": dt.date.today().isoformat(),
              "hardware": hardware(), "command": " ".join(sys.argv), "split": split, "n_layer": n_layer,
              "rows": {str(k): v for k, v in rows.items()}}
    args.results.mkdir(parents=True, exist_ok=True)
    stem = f"{result['date']}-early-control-{args.model.stem}"
    write_atomic(args.results / f"{stem}.json", json.dumps(result, indent=2) + "\n")
    md = [f"# Sweep one against a stock prefill of the first {split} layers: {args.model.name}", "",
          f"`{result['command']}`", "",
          f"| tokens | full stock | {split}/{n_layer} of it | stock, first {split} layers | RidgeFill sweep one |",
          "|---|---|---|---|---|"]
    md += [f"| {n} | {r['stock_full_ms']:.0f} | {r['share_of_full']:.0f} | {r['stock_first_layers_ms']:.0f} | "
           f"{r['sweep_one_ms']:.0f} |" for n, r in rows.items()]
    write_atomic(args.results / f"{stem}.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
