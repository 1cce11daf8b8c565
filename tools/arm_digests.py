#!/usr/bin/env python3
"""sha256 of the logits of every RidgeFill arm and selector the tests cover, on tiny random models (CPU).

A refactor of the engine proves itself with this: run it on the commit before and on the commit after, and
every digest must be the same.

  python tools/arm_digests.py -o before.json                 # on the commit before the refactor
  python tools/arm_digests.py -o after.json --compare before.json   # exits 1 and names the arms that moved

A change meant to move some arms keeps the logits (--logits DIR on both commits, --compare-logits DIR on the
second): each moved arm then shows how far it moved beside how far it is from the stock prefill.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARCHS = ("llama", "qwen2", "qwen3")
SPLIT = 1
# the hybrids: 8 layers (DeltaNet 0-2 and 4-6, attention 3 and 7) with slow decay, split 2, so both kinds are late;
# the arms their engine serves (the attention selector and the blind controls are the dense engine's)
HYBRIDS = ("qwen35", "qwen3next")
HYBRID_SPLIT, HYBRID_LAYERS = 2, 8
HYBRID_ARMS = ("ridge", "identity", "none", "plumb", "oracle", "listed_rows", "random_rows", "probe", "budget",
               "budget_no_whole_numbers", "random_budget", "protected", "rescale", "rescale_probe")
PROMPT = ("RidgeFill predicts the input of every late layer from the split layer's state, and the layer only "
          "writes its cache from that prediction. Order 48213 ships with code 7719-0042 on 2026-12-02. ") * 5 + \
         "Question: which code ships with order 48213?"

# every parameter set explicitly, so that no run inherits the one before it
DEFAULTS = {"tail": 40, "fill": "ridge", "exact_rows": [], "exact_random": [0, 0], "chunk": 48, "min_prefix": 0,
            "probe": [0, 0], "attention": [64, 0.0], "blind": False, "rescale": [0, False, False],
            "random_budget": [0.0, 0], "protected": 0.0, "whole_numbers": True}
ARMS = {
    "ridge": {}, "identity": {"fill": "identity"}, "none": {"fill": "none"}, "plumb": {"fill": "plumb"},
    "oracle": {"fill": "oracle"}, "listed_rows": {"exact_rows": [10, 57]}, "random_rows": {"exact_random": [12, 7]},
    "probe": {"probe": [16, 8]}, "budget": {"probe_budget": [16, 1.0]},
    "budget_no_whole_numbers": {"probe_budget": [16, 1.0], "whole_numbers": False},
    "random_budget": {"probe_budget": [16, 1.0], "random_budget": [1.0, 3]},
    "attention": {"attention": [16, 0.2, [0]]}, "protected": {"protected": 0.25},
    "blind_probe": {"probe": [16, 8], "blind": True}, "blind_attention": {"attention": [16, 0.2, [0]], "blind": True},
    "rescale": {"rescale": [8, True, True]}, "rescale_probe": {"rescale": [8, True, True], "probe": [16, 8]},
}
ROWS_ARMS = {"rows_ridge": {}, "rows_none": {"fill": "none"}}  # the prefill's own logits for its last 40 rows
STREAMED_ARMS = ("ridge", "probe", "budget")


def make_model(folder: Path, arch: str, hybrid: bool) -> tuple[Path, Path]:
    """A tiny model and its maps, merged with a fixed token frequency table so that protected rows differ."""
    from ridgefill_gguf.maps import format as fmt
    from ridgefill_gguf.maps.merge import merge
    from ridgefill_gguf.maps.synthetic import tiny_model_with_maps

    if hybrid:
        sys.path.insert(0, str(ROOT / "tests"))
        from test_reference_hybrid import long_memory_copy

        model, maps = tiny_model_with_maps(folder, arch, n_layer=HYBRID_LAYERS, split=HYBRID_SPLIT,
                                           prepare=long_memory_copy)
    else:
        model, maps = tiny_model_with_maps(folder, arch, n_layer=4, split=SPLIT)
    n_vocab = fmt.model_fingerprint(model).n_vocab
    freq = 1.0 + (np.arange(n_vocab) % 97).astype(np.float32)
    return model, merge([maps], folder / f"{arch}.maps-freq.gguf", token_freq=freq)


def runs_for(placement: str, hybrid: bool = False) -> list[dict]:
    names = ARMS if placement == "resident" else {k: ARMS[k] for k in STREAMED_ARMS}
    if hybrid:
        names = {k: v for k, v in names.items() if k in HYBRID_ARMS}
    runs = [{"name": "stock", "stock": True}] if placement == "resident" else []
    runs += [{"name": n, "params": {**DEFAULTS, **p}} for n, p in names.items()]
    if placement == "resident":
        runs += [{"name": n, "rows": 40, "params": {**DEFAULTS, **p}} for n, p in ROWS_ARMS.items()]
    return runs


def run_one(model: Path, maps: Path, flash: bool, placement: str, tmp: Path, hybrid: bool = False,
            keep: Path | None = None) -> dict[str, dict]:
    spec = {"model": str(model), "n_ctx": 512, "prompt": PROMPT, "runs": runs_for(placement, hybrid),
            "session": {"n_batch": 64, "n_ubatch": 32, "n_threads": 2, "maps": str(maps), "placement": placement,
                        "flash_attn": flash}}
    spec_file, out = tmp / "spec.json", tmp / "out.npz"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "ridgefill_gguf.engine.session", "--build", "ridgefill",
                           "--spec", str(spec_file), "-o", str(out)], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"arm_digests: the engine run failed:\n{proc.stdout[-3000:]}")
    stats = json.loads(out.with_suffix(".json").read_text())
    if keep:
        keep.parent.mkdir(parents=True, exist_ok=True)
        os.replace(out, keep)
        out = keep
    result = {}
    with np.load(out) as data:
        for run in spec["runs"]:
            arr = data[run["name"]]
            st = stats.get(run["name"], {})
            result[run["name"]] = {"sha256": hashlib.sha256(arr.tobytes()).hexdigest(),
                                   "applied": st.get("applied"), "exact": st.get("n_exact"),
                                   "filled": st.get("n_filled")}
    return result


def report_moves(moved: list[str], now: Path, before: Path) -> None:
    """Each moved arm's largest logit change beside its largest distance from the stock prefill."""
    for arm in moved:
        key, name = arm.rsplit("|", 1)
        file = key.replace("|", "_").replace("=", "-") + ".npz"
        stock_file = file.replace("_streamed", "_resident")  # the stock prefill runs with resident maps only
        with np.load(now / file) as a, np.load(before / file) as b, np.load(before / stock_file) as s:
            old = b[name].astype(np.float64)
            moved_by = float(np.max(np.abs(a[name] - old)))
            stock = s["stock"].reshape(-1, old.shape[-1])[-1]
            from_stock = float(np.max(np.abs(old.reshape(-1, old.shape[-1])[-1] - stock)))
        print(f"  {arm}: moved by {moved_by:.3g} (max |logit change|); its last row from stock's {from_stock:.3g}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", type=Path, required=True, help="JSON of digests to write")
    ap.add_argument("--compare", type=Path, help="digests of the commit before: exit 1 where any differs")
    ap.add_argument("--hybrids", action="store_true", help="the hybrids' arms too (qwen35, qwen3next)")
    ap.add_argument("--logits", type=Path, help="folder to keep every run's logits in (one .npz per model and mode)")
    ap.add_argument("--compare-logits", type=Path, help="the commit before's --logits folder: how far moved arms moved")
    args = ap.parse_args()
    digests = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        archs = [(a, False) for a in ARCHS] + ([(a, True) for a in HYBRIDS] if args.hybrids else [])
        for arch, hybrid in archs:
            model, maps = make_model(tmp, arch, hybrid)
            for flash in (False, True):
                for placement in ("resident", "streamed"):
                    key = f"{arch}|flash={'on' if flash else 'off'}|{placement}"
                    keep = args.logits / (key.replace("|", "_").replace("=", "-") + ".npz") if args.logits else None
                    digests[key] = run_one(model, maps, flash, placement, tmp, hybrid, keep)
                    print(f"{key}: {len(digests[key])} arms", flush=True)
    n = sum(len(v) for v in digests.values())
    not_applied = [f"{k}|{a}" for k, v in digests.items() for a, r in v.items() if a != "stock" and r["applied"] != 1]
    if not_applied:
        raise SystemExit(f"arm_digests: RidgeFill did not run for {', '.join(not_applied)}")
    tmp_out = args.out.with_suffix(".tmp")
    tmp_out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out.write_text(json.dumps({"arms": n, "digests": digests}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp_out, args.out)
    print(f"arm_digests: {n} arms -> {args.out}")
    if args.compare:
        before = json.loads(args.compare.read_text())["digests"]
        moved = [f"{k}|{a}" for k, v in digests.items() for a, r in v.items()
                 if before.get(k, {}).get(a, {}).get("sha256") != r["sha256"]]
        missing = [f"{k}|{a}" for k, v in before.items() for a in v
                   if a not in digests.get(k, {}) and (args.hybrids or k.split("|")[0] not in HYBRIDS)]
        if moved and args.compare_logits and args.logits:
            report_moves(moved, args.logits, args.compare_logits)
        if moved or missing:
            print(f"arm_digests: {len(moved)} arms moved: {', '.join(moved)}" +
                  (f"; missing: {', '.join(missing)}" if missing else ""))
            return 1
        print(f"arm_digests: all {n} arms byte-identical to {args.compare}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
