#!/usr/bin/env python3
"""Add the ceilings that time a hybrid's state update to a bench result already written (its JSON and Markdown):
    python tools/state_ceiling.py RESULT.json GDN.json [--tokens 32768]
GDN.json is tools/gpu/bench-gdn.sh's output from the same device; its one-sequence cell at --tokens gives the
time per row."""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ridgefill_gguf.bench import add_state_update_ceilings, markdown  # noqa: E402
from ridgefill_gguf.util import write_atomic  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("gdn", type=Path)
    ap.add_argument("--tokens", type=int, default=32768, help="the gdn_bench cell to take (one sequence)")
    a = ap.parse_args()
    cells = [c for c in json.loads(a.gdn.read_text())["cells"] if c["seqs"] == 1 and c["tokens"] == a.tokens]
    if not cells:
        sys.exit(f"state_ceiling: {a.gdn} has no one-sequence cell of {a.tokens} rows")
    r = add_state_update_ceilings(json.loads(a.result.read_text()), cells[0]["us_per_token"])
    write_atomic(a.result, json.dumps(r, indent=2) + "\n")
    write_atomic(a.result.with_suffix(".md"), markdown(r))
    print(f"{a.result}: state update {cells[0]['us_per_token']:.4f} us per row")


if __name__ == "__main__":
    main()
