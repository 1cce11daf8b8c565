"""Mixed serving: one long request arrives while C - 1 other users stream tokens from the same llama-server, stock
prefill against RidgeFill in the same server run. The others' stall is the longest gap between two of their tokens
while the new request prefills; their inter-token latency (ITL) and throughput come from client timestamps."""
from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from dataclasses import dataclass, field

from .serve import Server, ServerError


@dataclass
class Stream:
    """One streamed /completion: when each token arrived, and the final message's timings."""
    t_sent: float = 0.0
    t_tokens: list[float] = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    error: str = ""


def stream_completion(srv: Server, body: dict, out: Stream, stop: threading.Event | None = None) -> None:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=3600)
    try:
        out.t_sent = time.perf_counter()
        conn.request("POST", "/completion", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:500]!r}"
            return
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            msg = json.loads(line[6:])
            if msg.get("content") or msg.get("tokens"):
                out.t_tokens.append(time.perf_counter())
            if msg.get("stop"):
                out.timings = msg.get("timings", {})
                return
            if stop is not None and stop.is_set():
                return  # closing the connection cancels the request
    except Exception as e:  # a failed stream is counted, not raised: the run reports its errors
        out.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def gaps_within(t: list[float], t0: float, t1: float) -> list[float]:
    """Gaps between consecutive tokens, for gaps that overlap [t0, t1] (the gap spanning t0 included)."""
    return [b - a for a, b in zip(t, t[1:]) if b >= t0 and a <= t1]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def one_cell(srv: Server, prompt: list[int], n_users: int, ridgefill: bool, *, others_prompt: list[int],
             n_warm: int = 4, n_after: int = 4) -> dict:
    """C - 1 users stream; once each has n_warm tokens the long request comes; they stop n_after tokens after its
    first token."""
    stop = threading.Event()
    others = [Stream() for _ in range(n_users - 1)]
    body = {"prompt": others_prompt, "n_predict": 100000, "ignore_eos": True, "temperature": 0,
            "cache_prompt": False, "ridgefill": False}
    threads = [threading.Thread(target=stream_completion, args=(srv, body, s, stop), daemon=True) for s in others]
    t_start = time.perf_counter()
    for th in threads:
        th.start()
    deadline = time.monotonic() + 600
    while any(len(s.t_tokens) < n_warm and not s.error for s in others) and time.monotonic() < deadline:
        time.sleep(0.01)
    new = Stream()
    stream_completion(srv, {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": False,
                            "ridgefill": ridgefill}, new)
    t_first = new.t_tokens[0] if new.t_tokens else time.perf_counter()
    marks = [len(s.t_tokens) for s in others]
    while any(len(s.t_tokens) < m + n_after and not s.error for s, m in zip(others, marks)) and \
            time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    for th in threads:
        th.join(timeout=60)
    t_end = max([s.t_tokens[-1] for s in others if s.t_tokens] + [t_first])
    stalls = [g for s in others for g in gaps_within(s.t_tokens, new.t_sent, t_first)]
    itl = [b - a for s in others for a, b in zip(s.t_tokens, s.t_tokens[1:])]
    n_other_tokens = sum(len(s.t_tokens) for s in others)
    errors = [s.error for s in others + [new] if s.error]
    return {"ridgefill": ridgefill, "users": n_users, "ttft_s": t_first - new.t_sent,
            "prompt_ms": new.timings.get("prompt_ms"), "rf": new.timings.get("ridgefill"),
            "stall_max_s": max(stalls, default=0.0), "stall_p99_s": percentile(stalls, 0.99),
            "itl_median_s": statistics.median(itl) if itl else 0.0,
            "others_tokens_during": sum(1 for s in others for t in s.t_tokens if new.t_sent <= t <= t_first),
            "others_tok_per_s": n_other_tokens / max(t_end - t_start, 1e-9), "errors": errors}


def summarize(cells: list[dict]) -> list[dict]:
    """Medians per (users, kv, arm) over repetitions."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["users"], c.get("kv", ""), c["ridgefill"]), []).append(c)
    rows = []
    for (users, kv, rf), cs in sorted(groups.items()):
        med = {k: statistics.median([c[k] for c in cs]) for k in
               ("ttft_s", "stall_max_s", "stall_p99_s", "itl_median_s", "others_tok_per_s", "others_tokens_during")}
        rows.append({"users": users, "kv": kv, "arm": "ridgefill" if rf else "stock", "reps": len(cs),
                     "worst_stall_s": max(c["stall_max_s"] for c in cs), "longest_slice": longest_slice(cs),
                     "errors": sum(len(c["errors"]) for c in cs), **med})
    return rows


def longest_slice(cells: list[dict]) -> str:
    """The RidgeFill prefill's longest run while the other slots waited, over the cells, with its last step's stage
    ("" for stock, or a server that does not report it)."""
    runs = [(c["rf"]["slice_max_ms"], c["rf"]["slice_max_stage"]) for c in cells
            if c.get("rf") and "slice_max_ms" in c["rf"]]
    if not runs:
        return ""
    ms, stage = max(runs)
    return f"{ms:.0f} ({stage})"


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| users | KV | arm | TTFT s | others' worst stall s | p99 stall s | ITL ms | others tok/s | "
             "their tokens during the prefill | longest slice ms (stage) | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['users']} | {r['kv']} | {r['arm']} | {r['ttft_s']:.2f} | {r['worst_stall_s']:.3f} | "
                     f"{r['stall_p99_s']:.3f} | {1000 * r['itl_median_s']:.1f} | {r['others_tok_per_s']:.1f} | "
                     f"{r['others_tokens_during']:.0f} | {r.get('longest_slice', '')} | {r['errors']} |")
    return "\n".join(lines) + "\n"


def server_cells(srv: Server, lengths: list[int], users: list[int], *, kv: str, ym: int, reps: int, warmup: bool,
                 log) -> list[dict]:
    """Every length, user count and repetition on one server, stock and RidgeFill alternating."""
    cells = []
    for n in lengths:
        prompt = [1] + [1000 + (i * 7919) % 30000 for i in range(n - 1)]
        for c in users:
            if warmup:  # buffers, graphs and batch shapes of this length and user count, unrecorded
                for rf in (False, True):
                    one_cell(srv, prompt, c, rf, others_prompt=prompt[:16], n_warm=2, n_after=1)
            for rep in range(reps):
                for rf in (False, True):
                    cell = one_cell(srv, prompt, c, rf, others_prompt=prompt[:16])
                    cell.update(kv=kv, yield_ms=ym, tokens=n, rep=rep)
                    cells.append(cell)
                    log(f"serving: {n} tokens, {c} users, {kv} KV, yield {ym} ms, "
                        f"{'RidgeFill' if rf else 'stock'}: TTFT {cell['ttft_s']:.2f} s, others' worst "
                        f"stall {cell['stall_max_s']:.3f} s, errors {len(cell['errors'])}")
    return cells


def run_serving(model, maps, lengths: list[int], users: list[int], *, kv_modes=("unified", "separate"),
                yield_ms=(50,), reps: int = 1, tail: int = 4096, select: str = "probe", n_gpu_layers: int | None = None,
                threads: int | None = None, out_dir="results/serving", label: str = "serving", warmup: bool = True,
                extra: tuple[str, ...] = (), log=print) -> dict:
    """Every cell (prompt length, users, KV mode, yield setting, arm) on one server per KV mode and yield setting,
    stock and RidgeFill alternating; results as JSON and Markdown in out_dir."""
    import datetime
    import sys
    from pathlib import Path

    from .util import hardware, write_atomic

    n_slots = max(users)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    cells, not_run = [], []
    for kv in kv_modes:
        for ym in yield_ms:
            # unified: the slots share the cache, so one long prompt and the others' short ones fit; separate:
            # every slot gets a long prompt's worth
            n_ctx = max(lengths) + 1024 * n_slots if kv == "unified" else n_slots * (max(lengths) + 1024)
            args = ("-kvu" if kv == "unified" else "-no-kvu", "--ridgefill-yield-ms", str(ym), *extra)
            log_path = Path(out_dir) / f"{label}-{kv}-yield{ym}.server.log"
            try:
                with Server(model, maps, tail=tail, select=select, slots=n_slots, n_ctx=n_ctx, threads=threads,
                            n_gpu_layers=n_gpu_layers, extra=args, log_path=log_path) as srv:
                    cells += server_cells(srv, lengths, users, kv=kv, ym=ym, reps=reps, warmup=warmup, log=log)
            except ServerError as e:  # e.g. separate KV for every slot does not fit the device: the others still run
                reason = str(e).splitlines()[0]
                not_run.append({"kv": kv, "yield_ms": ym, "n_ctx": n_ctx, "slots": n_slots, "reason": reason})
                log(f"serving: {kv} KV, yield {ym} ms, a context of {n_ctx} over {n_slots} slots: not run: {reason}")
    rows = []
    for n in lengths:
        for ym in yield_ms:
            for r in summarize([c for c in cells if c["tokens"] == n and c["yield_ms"] == ym]):
                rows.append({"tokens": n, "yield_ms": ym, **r})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{datetime.date.today().isoformat()}-{label}"
    result = {"command": " ".join(sys.argv), "hardware": hardware(), "model": str(model), "maps": str(maps),
              "tail": tail, "select": select, "cells": cells, "summary": rows, "not_run": not_run}
    write_atomic(stem.with_suffix(".json"), json.dumps(result, indent=1) + "\n")
    md = []
    for n in lengths:
        for ym in yield_ms:
            part = [r for r in rows if r["tokens"] == n and r["yield_ms"] == ym]
            md.append(markdown(part, f"## {n} tokens, --ridgefill-yield-ms {ym}"))
    md += [f"Not run: {r['kv']} KV, yield {r['yield_ms']} ms (a context of {r['n_ctx']} over {r['slots']} slots): "
           f"{r['reason']}\n" for r in not_run]
    write_atomic(stem.with_suffix(".md"), f"# Mixed serving: {label}\n\n`{result['command']}`\n\n" + "\n".join(md))
    files = [str(stem.with_suffix(".json")), str(stem.with_suffix(".md"))]
    try:
        plot_stalls(rows, stem.with_suffix(".png"), label)
        files.append(str(stem.with_suffix(".png")))
    except ImportError:  # matplotlib is optional
        pass
    return {"files": files, "summary": rows}


def plot_stalls(rows: list[dict], path, label: str) -> None:
    """The others' worst stall per cell, stock beside RidgeFill."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .util import save_figure

    cells = sorted({(r["tokens"], r["yield_ms"], r["kv"], r["users"]) for r in rows})
    value = {(r["tokens"], r["yield_ms"], r["kv"], r["users"], r["arm"]): r["worst_stall_s"] for r in rows}
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(cells)), 3.5))
    xs = range(len(cells))
    for k, (arm, shift) in enumerate((("stock", -0.2), ("ridgefill", 0.2))):
        ax.bar([x + shift for x in xs], [value.get((*c, arm), 0) for c in cells], width=0.4, label=arm)
    ax.set_xticks(list(xs), [f"{t // 1024}K {kv[0]} C={u}" + (f" y{y}" if y else "") for t, y, kv, u in cells],
                  rotation=60, fontsize=7)
    ax.set_ylabel("others' worst stall (s)")
    ax.set_title(f"Mixed serving: {label}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
