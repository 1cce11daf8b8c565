#!/usr/bin/env python3
"""Benchmark `ridgefill-gguf convert` on int8 maps of a real model's size (default: a 27B model's
48 maps of 5120x5120, 1.2 GiB), and write the result as JSON and Markdown under results/convert/.

  python tools/bench_convert.py [--layers 48] [--d 5120] [--repeats 3]

Time and peak memory (max RSS) are those of the convert process, read from wait4; the source files are
in the page cache (they were just written or read), as they would be right after a download.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ridgefill_gguf.maps.synthetic import write_int8_folder  # noqa: E402
from ridgefill_gguf.util import hardware, write_atomic  # noqa: E402


def run_once(cmd: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"convert failed: {proc.stderr.read().decode()}")
    return seconds, usage.ru_maxrss * 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--d", type=int, default=5120)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench-convert")
    ap.add_argument("--results", type=Path, default=ROOT / "results" / "convert")
    args = ap.parse_args()

    src = args.work / f"int8-{args.layers}x{args.d}"
    if not (src / "ridgefill.json").exists():
        print(f"bench: writing {args.layers} synthetic int8 maps of {args.d}x{args.d} to {src} ...", flush=True)
        shutil.rmtree(src, ignore_errors=True)
        split = 16
        write_int8_folder(src, split, list(range(split, split + args.layers)), args.d, seed=0)
    src_bytes = sum(f.stat().st_size for f in src.iterdir())
    out = args.work / "maps.gguf"
    cli = str(Path(sys.executable).with_name("ridgefill-gguf"))
    cmd = [cli, "convert", str(src), "-o", str(out), "--arch", "qwen35", "--force", "-q"]
    runs = []
    for i in range(args.repeats):
        seconds, rss = run_once(cmd)
        runs.append({"seconds": round(seconds, 3), "peak_rss_bytes": rss})
        print(f"bench: run {i + 1}/{args.repeats}: {seconds:.2f} s, peak RSS {rss / 2**30:.2f} GiB", flush=True)
    median_s = statistics.median(r["seconds"] for r in runs)
    peak = max(r["peak_rss_bytes"] for r in runs)
    result = {
        "benchmark": "convert int8 maps to Q8_0 GGUF",
        "date": dt.date.today().isoformat(),
        "hardware": hardware(),
        "command": " ".join(cmd),
        "maps": {"layers": args.layers, "d_out": args.d, "d_in": args.d, "source_bytes": src_bytes,
                 "output_bytes": out.stat().st_size},
        "runs": runs,
        "median_seconds": median_s,
        "max_peak_rss_bytes": peak,
        "targets": {"seconds": 30, "peak_rss_gib": 4},
        "meets_targets": median_s < 30 and peak < 4 * 2**30,
    }
    stem = f"{result['date']}-{args.layers}x{args.d}-{result['hardware']['cores']}cores"
    args.results.mkdir(parents=True, exist_ok=True)
    write_atomic(args.results / f"{stem}.json", json.dumps(result, indent=2) + "\n")
    md = [f"# convert: {args.layers} int8 maps of {args.d}x{args.d} to Q8_0", "",
          f"{result['date']}, {result['hardware']['cpu']}, {result['hardware']['cores']} cores, "
          f"{result['hardware']['mem_gib']} GiB", "", f"`{result['command']}`", "",
          "| source | output | median time | peak memory | target |", "|---|---|---|---|---|",
          f"| {src_bytes / 2**30:.2f} GiB | {out.stat().st_size / 2**30:.2f} GiB | {median_s:.1f} s "
          f"(of {args.repeats}) | {peak / 2**30:.2f} GiB | < 30 s, < 4 GiB: "
          f"{'met' if result['meets_targets'] else 'MISSED'} |", ""]
    write_atomic(args.results / f"{stem}.md", "\n".join(md))
    print("\n".join(md))
    out.unlink(missing_ok=True)
    return 0 if result["meets_targets"] else 1


if __name__ == "__main__":
    sys.exit(main())
