"""Per needle: retrieved or not, by how many of its rows ran exactly (docs/eval.md, session 8).

    python tools/needle_rows.py RUN_DIR [RUN_DIR ...] [--arm ridge+probe]

Each RUN_DIR is an `eval needles` output whose answers record `needle_rows_exact`. Only needles before the tail
count (the filled region). A needle is "whole" when every row of it ran exactly, "split" otherwise; for each run
and both kinds it prints how many needles the arm and the exact arm retrieved (the needle's answer in the
prediction)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ridgefill_gguf.eval.documents import jsonl_parts, load_jsonl  # noqa: E402
from ridgefill_gguf.eval.needles import Sample  # noqa: E402


def needle_table(run_dir: Path, arm: str) -> dict[str, dict[str, int]]:
    """{"whole"|"split": {"needles", "arm", "exact"}} for one run."""
    for name in ("samples.jsonl", "results.jsonl"):
        if not jsonl_parts(run_dir / name):
            raise SystemExit(f"needle_rows: {run_dir / name} is missing: not an `eval needles` folder")
    samples = {s["sample_id"]: Sample(**s) for s in load_jsonl(run_dir / "samples.jsonl")}
    answers = {(a["sample"], a["arm"]): a for a in load_jsonl(run_dir / "results.jsonl")}
    table = {kind: {"needles": 0, "arm": 0, "exact": 0} for kind in ("whole", "split")}
    for sid, sample in samples.items():
        got, exact = answers.get((sid, arm)), answers.get((sid, "exact"))
        if not got or not exact or "needle_rows_exact" not in got["stats"]:
            continue
        first_tail = sample.first_tail_row(got["stats"]["n_tail"])
        for (first, end), n_exact, answer in zip(sample.needle_rows, got["stats"]["needle_rows_exact"],
                                                 sample.answers):
            if end > first_tail:
                continue
            row = table["whole" if n_exact == end - first else "split"]
            row["needles"] += 1
            row["arm"] += answer in got["pred"]
            row["exact"] += answer in exact["pred"]
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--arm", default="ridge+probe")
    args = ap.parse_args()
    print(f"| run | needles | kept whole: needles, {args.arm}, exact | kept in part: needles, {args.arm}, exact |")
    print("|---|---|---|---|")
    for run in args.runs:
        t = needle_table(run, args.arm)
        w, s = t["whole"], t["split"]
        print(f"| {run} | {w['needles'] + s['needles']} | {w['needles']}, {w['arm']}, {w['exact']} | "
              f"{s['needles']}, {s['arm']}, {s['exact']} |")


if __name__ == "__main__":
    main()
