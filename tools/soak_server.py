#!/usr/bin/env python3
"""Soak llama-server with RidgeFill (ridgefill_gguf.soak): a tiny random llama (or a qwen35 hybrid) with random
maps, 4 slots, 1,000 mixed requests; results as JSON and Markdown in results/soak/.

  python tools/soak_server.py [-n 1000] [--arch qwen35] [-o results/soak]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    from ridgefill_gguf.soak import SOAK_LAYERS, run_soak, soak_model
    from ridgefill_gguf.util import hardware, write_atomic

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=1000, help="requests")
    ap.add_argument("--cache-ram", type=int, default=None, help="llama-server's --cache-ram in MiB (its default)")
    ap.add_argument("--arch", choices=tuple(SOAK_LAYERS), default="llama",
                    help="qwen35: a hybrid, whose late layers yield to the other slots and whose slots save checkpoints")
    ap.add_argument("--slots", type=int, default=4,
                    help="server slots; with 1, the slot's last RidgeFill prefill is the engine's last, so exact-only "
                         "follow-ups resume from its held split state")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "results" / "soak")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        model, maps = soak_model(d, args.arch)
        r = run_soak(model, maps, n=args.n, slots=args.slots, cache_ram_mib=args.cache_ram, log_dir=d)
    r.update(command=" ".join(sys.argv), hardware=hardware(),
             model="tiny random {}, {} layers, split {}".format(args.arch, *SOAK_LAYERS[args.arch]))
    ram = "" if args.cache_ram is None else f"-cache-ram-{args.cache_ram}"
    arch = "" if args.arch == "llama" else f"-{args.arch}"
    slots = "" if args.slots == 4 else f"-slots-{args.slots}"
    stem = args.out / f"{datetime.date.today().isoformat()}-soak-{args.n}{arch}{slots}{ram}"
    write_atomic(stem.with_suffix(".json"), json.dumps(r, indent=1) + "\n")
    def growth(rss: list) -> float:
        return rss[-1][1] - rss[0][1] if len(rss) > 1 else 0.0

    md = [f"# Soak: {r['requests']} requests over {r['slots']} slots ({r['clients']} clients), --cache-ram "
          f"{'default' if args.cache_ram is None else args.cache_ram}", "",
          f"`{r['command']}`", "", f"- model: {r['model']}",
          f"- {r['seconds']:.0f} s; server alive at the end: {r['server_alive']}",
          f"- errors: {len(r['errors'])}; closed by the client before the end: {r['cancelled']}, of them RidgeFill "
          f"prefills cancelled in flight (the server log): {r['ridgefill_cancelled_in_flight']}; "
          f"RidgeFill ran: {r['ridgefill_ran']}, of them "
          f"exact-only follow-ups resumed from the held split state: {r['resumed']}",
          f"- finished stock requests replayed one at a time on one slot: {r['stock_compared']}; the patched server "
          f"(RidgeFill off, maps attached) differing from upstream there: {len(r['off_vs_upstream_alone'])}; "
          f"the concurrent run's text differing from upstream alone: {len(r['stock_mismatched'])}, and upstream's own "
          f"concurrent run of the same workload: {len(r['upstream_concurrent_mismatched'])} (batching moves near ties)",
          f"- server RSS (MiB) after every 100 requests: {', '.join(f'{m:.0f}' for _, m in r['rss_mib'])} "
          f"(growth from the first sample {growth(r['rss_mib']):+.0f}); upstream's under the same workload: "
          f"{', '.join(f'{m:.0f}' for _, m in r['upstream_rss_mib'])} ({growth(r['upstream_rss_mib']):+.0f})",
          "", "```", *r["metrics"], "```", ""]
    write_atomic(stem.with_suffix(".md"), "\n".join(md))
    print("\n".join(md))
    return 0 if not r["errors"] and r["server_alive"] and not r["off_vs_upstream_alone"] else 1


if __name__ == "__main__":
    sys.exit(main())
