#!/usr/bin/env python3
"""Capture speed against plain prefill, side by side in one process, on the same documents.

  python tools/bench_capture.py MODEL.gguf --split 9 [--split 12 ...] --text PATH... [--docs 4] [--tokens 2048]

Plain prefill: the same patched build, the same context settings, capture off. Capture: capture on for the
split layers and above, plus the float64 sums, as `fit` runs them (on a GPU one document's sums overlap the
next document's prefill, so a pass is timed whole, up to its last sum). After one untimed warm-up document,
plain and capture passes over all documents alternate (--rounds); each pass gives tokens/s, the medians over
rounds give the ratio. Also the solve time of one lambda. Writes JSON and Markdown under results/capture/.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import torch  # noqa: E402

from ridgefill_gguf.fit.capture import Capturer, iter_documents, sums_device  # noqa: E402
from ridgefill_gguf.fit.solve import solve  # noqa: E402
from ridgefill_gguf.fit.sums import SplitSums  # noqa: E402
from ridgefill_gguf.util import hardware, write_atomic  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--split", dest="splits", type=int, action="append", required=True)
    ap.add_argument("--text", nargs="+", required=True)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="alternating plain and capture passes")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--n-gpu-layers", type=int, default=0, help="-1: every layer on the GPU")
    ap.add_argument("--results", type=Path, default=ROOT / "results" / "capture")
    args = ap.parse_args()

    cap = Capturer(args.model, min(args.splits), n_ctx=args.tokens, n_threads=args.threads,
                   n_gpu_layers=args.n_gpu_layers)
    docs = [d for _, d in zip(range(args.docs), iter_documents(args.text))]
    d, L = cap.n_embd, cap.n_layer
    sums = {s: SplitSums(s, list(range(s + 1, L)), d, d) for s in args.splits}
    toks = [cap.tokenize(doc.text, args.tokens) for doc in docs]

    def set_capture(on: bool) -> None:
        for layer in cap.layers:
            cap.bindings.capture_layer_input(cap.ctx, layer, on)

    def plain_pass(docs_tokens) -> float:
        set_capture(False)
        t0 = time.perf_counter()
        for tokens in docs_tokens:
            cap.llm.reset()
            for start in range(0, len(tokens), cap.n_batch):
                cap.llm.eval(tokens[start:start + cap.n_batch])
        return sum(map(len, docs_tokens)) / (time.perf_counter() - t0)

    def capture_pass(docs_tokens) -> float:
        set_capture(True)
        t0 = time.perf_counter()
        for tokens in docs_tokens:
            got = cap.capture(tokens, args.splits, device=sums_device())
            for s, rows in got.splits.items():
                sums[s].add(rows.x, rows.ys)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the pass ends with its last sum
        return sum(map(len, docs_tokens)) / (time.perf_counter() - t0)

    plain_pass(toks[:1]), capture_pass(toks[:1])  # warm-up: clocks, cuBLAS, buffers
    plain, capture = [], []
    for r in range(args.rounds):
        plain.append(plain_pass(toks))
        capture.append(capture_pass(toks))
        print(f"bench: round {r + 1}/{args.rounds}, {len(toks)} documents: plain {plain[-1]:.0f} tokens/s, "
              f"capture {capture[-1]:.0f} tokens/s", flush=True)
    cap.close()
    t0 = time.perf_counter()
    for ss in sums.values():
        solve(ss, 0.03)
    solve_s = time.perf_counter() - t0
    p, c = statistics.median(plain), statistics.median(capture)
    result = {"benchmark": "capture vs plain prefill", "date": dt.date.today().isoformat(), "hardware": hardware(),
              "command": " ".join(sys.argv), "model": args.model.name, "splits": args.splits,
              "documents": len(docs), "tokens_per_document": args.tokens, "rounds": args.rounds,
              "tokens_per_pass": sum(map(len, toks)),
              "plain_tokens_per_s": plain, "capture_tokens_per_s": capture,
              "median_plain": p, "median_capture": c, "capture_share_of_plain": c / p,
              "solve_seconds_one_lambda_all_splits": solve_s, "target_share": 0.75, "meets_target": c / p >= 0.75}
    stem = f"{result['date']}-{args.model.stem}-{'-'.join(map(str, args.splits))}"
    args.results.mkdir(parents=True, exist_ok=True)
    write_atomic(args.results / f"{stem}.json", json.dumps(result, indent=2) + "\n")
    md = [f"# capture vs plain prefill: {args.model.name}, splits {args.splits}", "",
          f"{result['date']}, {result['hardware']['cpu']}, {result['hardware']['cores']} cores", "",
          f"`{result['command']}`", "",
          "| passes x documents | plain (median) | capture (median) | capture / plain | solve, one lambda |",
          "|---|---|---|---|---|",
          f"| {args.rounds} x {len(docs)} x {args.tokens} tokens | {p:.0f} tokens/s | {c:.0f} tokens/s | {c / p:.2f} "
          f"(target >= 0.75: {'met' if result['meets_target'] else 'MISSED'}) | {solve_s:.2f} s |", ""]
    write_atomic(args.results / f"{stem}.md", "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
