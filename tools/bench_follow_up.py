#!/usr/bin/env python3
"""What a follow-up question over a long document costs, side by side on one machine: the conversation prefilled
stock, the follow-up as the exact-only policy served it before patch 0087 (a fresh RidgeFill prefill of the
conversation), the same resumed from the first prefill's held split state (llama_ridgefill_prefill_resume: layers
[0, S) only for the new rows; exact-only since patch 0087), resumed keeping the first prefill's exact rows exact (the
rerank policy, patch 0106), and the reuse of the first prefill's cache as it is (only the new rows, stock). JSON and
Markdown.

    tools/bench_follow_up.py MODEL --maps MAPS --out DIR [--doc FILE] [--tokens 4096] [--reps 3] [--tail 1024] \
        [--budget 1] [-ngl 99 --flash-attn --ubatch 512]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUESTION1 = "\n\nQuestion: what does the text above say about its first subject? Answer briefly.\nAnswer:"
FOLLOW_UP = (" It describes it in its opening lines.\n\nQuestion: and which other subject does it come to later, "
             "in other words than its own? Answer briefly.\nAnswer:")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--maps", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--doc", help="document text (default: standard library modules, as many as --tokens takes)")
    ap.add_argument("--tokens", type=int, default=4096, help="document tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tail", type=int, default=1024)
    ap.add_argument("--budget", type=float, default=1.0, help="the probe's budget factor")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    ap.add_argument("--flash-attn", action="store_true")
    ap.add_argument("--ubatch", type=int, default=512, help="n_ubatch and n_batch")
    ap.add_argument("--follow-up-repeat", type=int, default=1,
                    help="the follow-up question this many times: a hybrid resumes its held rows only up to the "
                         "batch boundary kept before the rows a selector scores (64), so give it more than that")
    a = ap.parse_args()

    from ridgefill_gguf.bench import default_text
    from ridgefill_gguf.engine.session import Session
    from ridgefill_gguf.util import hardware, write_atomic

    text = Path(a.doc).read_text(errors="replace") if a.doc else default_text(a.tokens * 6)
    sess = Session(a.model, n_ctx=a.tokens + 1024, n_threads=a.threads, maps=a.maps, n_gpu_layers=a.n_gpu_layers,
                   flash_attn=a.flash_attn, n_batch=a.ubatch, n_ubatch=a.ubatch)
    doc = sess.tokenize(text, special=False)[:a.tokens]
    first = doc + sess.tokenize(QUESTION1, special=False)
    conv = first + sess.tokenize(FOLLOW_UP * a.follow_up_repeat, special=False)
    # the probe at --budget (configure keeps what it was given: each arm says whether it keeps the held exact rows)
    params = {"fill": "ridge", "tail": a.tail, "probe_budget": (256, a.budget), "keep_held_exact": False}

    arms = ("stock", "exact_only_fresh", "exact_only_resumed", "rerank_resumed", "reuse")
    times: dict[str, list[float]] = {k: [] for k in arms}
    held, exact = [], {k: [] for k in ("first", "exact_only_resumed", "rerank_resumed")}
    for rep in range(a.reps):
        times["stock"].append(sess.stock(conv)[1])
        sess.ridgefill(first, **params)
        times["exact_only_fresh"].append(sess.ridgefill(conv, **params)[1])
        exact["first"].append(sess.ridgefill(first, **params)[2]["n_exact"])
        _, seconds, st = sess.ridgefill_resumed(conv, **params)
        times["exact_only_resumed"].append(seconds)
        held.append(st["held"])
        exact["exact_only_resumed"].append(st["n_exact"])
        sess.ridgefill(first, **params)
        _, seconds, st = sess.ridgefill_resumed(conv, **{**params, "keep_held_exact": True})
        times["rerank_resumed"].append(seconds)
        exact["rerank_resumed"].append(st["n_exact"])
        sess.ridgefill(first, **params)
        t0 = time.perf_counter()
        sess.extend(first, conv)
        times["reuse"].append(time.perf_counter() - t0)
        print(f"bench_follow_up: rep {rep + 1}/{a.reps}: " +
              ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()) + f", held {held[-1]}", flush=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"command": " ".join(sys.argv), "model": Path(a.model).name, "maps": Path(a.maps).name,
           "hardware": hardware(), "threads": a.threads, "n_gpu_layers": a.n_gpu_layers,
           "flash_attn": a.flash_attn, "ubatch": a.ubatch,
           "document_tokens": len(doc), "first_prompt_tokens": len(first), "conversation_tokens": len(conv),
           "params": params, "reps": a.reps, "held_rows": held, "exact_prefix_rows": exact, "seconds": times,
           "median_seconds": med,
           "share_of_stock": {k: med[k] / med["stock"] for k in med}}
    write_atomic(a.out / "bench_follow_up.json", json.dumps(res, indent=1) + "\n")
    rows = "\n".join(f"| {k} | {med[k]:.2f} | {med[k] / med['stock']:.2f} |" for k in med)
    md = (f"# A follow-up over a long document: {res['model']}\n\n{len(doc)} document tokens, a conversation of "
          f"{len(conv)}; the probe at budget {a.budget:g}, tail {a.tail}; median of {a.reps}; {a.threads} threads. "
          f"The resumed prefills took {held[0]} rows' split state from the first prefill; exact prefix rows: first "
          f"prefill {exact['first'][0]}, exact-only {exact['exact_only_resumed'][0]}, rerank "
          f"{exact['rerank_resumed'][0]}.\n\n"
          f"| follow-up prefill | seconds | share of stock |\n|---|---|---|\n{rows}\n")
    write_atomic(a.out / "bench_follow_up.md", md)
    print(md)


if __name__ == "__main__":
    main()
