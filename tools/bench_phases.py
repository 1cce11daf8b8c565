"""Where a bench run's RidgeFill time goes: each phase against its share of the stock time by multiply-accumulates.

    python tools/bench_phases.py results/bench/X.json [results/bench/X.server.log] [--placement resident]

Per length: RidgeFill's median prompt time; sweep one, fill and exact rows (the engine's own timings, medians),
each beside (in parentheses) its MAC share of the upstream build's median, or of the exact arm's where upstream
did not run; the rest of the prefill (the engine's total less its three phases); and what comes after the
prefill (the server's prompt time less the engine's total: the last prompt token's stock decode, the stock
worst-case reservation, a hybrid's last rows kept for its checkpoint). The engine's totals come from the result's
phases (`total_ms`, where the result records it), else from the server log's "RidgeFill prefill" lines of the timed
requests.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ridgefill_gguf.bench import mac_counts, markdown_table, split_placement  # noqa: E402
from ridgefill_gguf.random_gguf import ModelShape  # noqa: E402

LINE = re.compile(r"RidgeFill prefill: (\d+) rows .* in ([\d.]+) ms")


def engine_totals(log: Path, repeats: int) -> dict[int, float]:
    """Median engine total per prompt length over the last `repeats` RidgeFill prefills of that length (the
    warm-up comes first). The server decodes the prompt's last token itself, so tokens = rows + 1."""
    by_n = defaultdict(list)
    for line in log.read_text().splitlines():
        m = LINE.search(line)
        if m:
            by_n[int(m.group(1)) + 1].append(float(m.group(2)))
    return {n: statistics.median(v[-repeats:]) for n, v in by_n.items()}


def phase_rows(r: dict, totals: dict[int, float], placement: str) -> list[list]:
    shape = ModelShape(**{"arch": "unknown", **r["shape"]})
    upstream = {x["tokens"]: x["median_upstream_ms"] for x in r.get("off_vs_upstream") or []}
    out = []
    for x in r["rows"]:
        if x["placement"] != placement:
            continue
        n, rows, ph = x["tokens"], x["rows"], x["phases_ms"]
        c = mac_counts(shape, n, r["split"], rows["filled"], rows["exact"] + rows["tail"], tail=rows["tail"],
                       fill=split_placement(placement)[1])
        base = upstream.get(n, x["median_exact_ms"])
        share = {k: base * c[k] / c["stock"] for k in ("early", "fill", "exact")}
        measured = sum(ph[f"{k}_ms"] for k in ("early", "fill", "exact"))
        total = totals.get(n)
        out.append([n, f"{x['median_ridgefill_ms']:,.0f} ({sum(share.values()):,.0f})",
                    *(f"{ph[f'{k}_ms']:,.0f} ({share[k]:,.0f})" for k in ("early", "fill", "exact")),
                    f"{total - measured:,.0f}" if total else "n/a",
                    f"{x['median_ridgefill_ms'] - total:,.0f}" if total else "n/a",
                    "upstream" if n in upstream else "exact arm"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("server_log", type=Path, nargs="?",
                    help="the RidgeFill server's log of the same run and placement (for results without total_ms)")
    ap.add_argument("--placement", default="resident")
    args = ap.parse_args()
    r = json.loads(args.result.read_text())
    if args.server_log:
        totals = engine_totals(args.server_log, r["repeats"])
    else:
        totals = {x["tokens"]: x["phases_ms"]["total_ms"] for x in r["rows"]
                  if x["placement"] == args.placement and "total_ms" in x["phases_ms"]}
        if not totals:
            sys.exit(f"bench_phases: {args.result} has no engine totals (total_ms): give its server log")
    rows = phase_rows(r, totals, args.placement)
    print("\n".join(markdown_table(
        f"{args.result.name}, {args.placement}: ms, in parentheses the MAC share of the stock time",
        ["tokens", "RidgeFill", "sweep one", "fill", "exact rows", "rest of the prefill", "after the prefill",
         "stock time from"], rows)))


if __name__ == "__main__":
    main()
