#!/usr/bin/env python3
"""What checking a maps file's tensor data against its checksum costs at load: the engine loads the maps with and
without LLAMA_RIDGEFILL_VERIFY_DATA=1, each load in a process of its own (the engine reads the variable once), and
`ridgefill-gguf verify`'s check (Python) beside them. JSON and Markdown.

    tools/bench_verify_data.py MODEL MAPS --out DIR [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOAD = """
import sys, time
from ridgefill_gguf import libs
from ridgefill_gguf.engine import bindings
llama_cpp = libs.use_build("ridgefill")
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_gpu_layers=0, verbose=False)
t0 = time.perf_counter()
bindings.load_maps(llm.model, sys.argv[2]).free()
print(time.perf_counter() - t0)
"""


def load_seconds(model: str, maps: str, verify: bool) -> float:
    env = {**os.environ, "LLAMA_RIDGEFILL_VERIFY_DATA": "1" if verify else "0"}
    out = subprocess.run([sys.executable, "-c", LOAD, model, maps], env=env, capture_output=True, text=True,
                         check=True, timeout=600)
    return float(out.stdout.strip().splitlines()[-1])


def python_check_seconds(maps: str) -> float:
    from ridgefill_gguf.gguf_io import read_gguf
    from ridgefill_gguf.maps.format import check_checksum

    t0 = time.perf_counter()
    problems = check_checksum(read_gguf(maps))
    if problems:
        raise SystemExit(f"{maps}: {problems[0]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("maps")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    from ridgefill_gguf.util import hardware, write_atomic

    seconds: dict[str, list[float]] = {"load": [], "load_verified": [], "verify_cli_check": []}
    for rep in range(a.reps):  # alternating, so a warm page cache serves both alike
        seconds["load"].append(load_seconds(a.model, a.maps, False))
        seconds["load_verified"].append(load_seconds(a.model, a.maps, True))
        seconds["verify_cli_check"].append(python_check_seconds(a.maps))
        print(f"bench_verify_data: rep {rep + 1}/{a.reps}: " + ", ".join(f"{k} {v[-1]:.3f} s"
                                                                          for k, v in seconds.items()), flush=True)
    size = Path(a.maps).stat().st_size
    med = {k: statistics.median(v) for k, v in seconds.items()}
    res = {"command": " ".join(sys.argv), "hardware": hardware(), "maps": Path(a.maps).name, "maps_bytes": size,
           "reps": a.reps, "seconds": seconds, "median_seconds": med,
           "added_by_the_check_s": med["load_verified"] - med["load"],
           "check_mb_per_s": size / 1e6 / max(med["load_verified"] - med["load"], 1e-9)}
    write_atomic(a.out / "bench_verify_data.json", json.dumps(res, indent=1) + "\n")
    rows = "\n".join(f"| {k} | {v:.3f} |" for k, v in med.items())
    md = (f"# The maps' tensor data checksum at load: {res['maps']}\n\n{size / 2**20:.0f} MiB; medians of {a.reps}; "
          f"the engine's load in a process of its own, with and without `LLAMA_RIDGEFILL_VERIFY_DATA=1`.\n\n"
          f"| | seconds |\n|---|---|\n{rows}\n\nThe check adds {res['added_by_the_check_s']:.2f} s "
          f"(about {res['check_mb_per_s']:.0f} MB/s).\n\n`{res['command']}`\n")
    write_atomic(a.out / "bench_verify_data.md", md)
    print(md)


if __name__ == "__main__":
    main()
