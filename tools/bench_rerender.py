"""Recompute bench results' MAC ceilings with the current formula and rewrite their JSON, Markdown and plot.

    python tools/bench_rerender.py results/bench/2026-12-01-qwen3-8b-q8_0-shape-h200.json [...]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ridgefill_gguf.bench import markdown, plot, refresh_ceilings  # noqa: E402
from ridgefill_gguf.util import write_atomic  # noqa: E402


def main(paths: list[str]) -> None:
    for p in map(Path, paths):
        r = refresh_ceilings(json.loads(p.read_text()))
        write_atomic(p, json.dumps(r, indent=2) + "\n")
        write_atomic(p.with_suffix(".md"), markdown(r))
        if r["rows"] and not r.get("partial"):
            plot(r, p.with_suffix(".png"))
        print(f"{p}: " + ", ".join(f"{x['placement']} {x['tokens']}: {100 * x['share_of_ceiling']:.0f}%"
                                   for x in r["rows"]))


if __name__ == "__main__":
    main(sys.argv[1:])
