"""Equivalence: with RidgeFill off, the patched build gives logits byte-identical to upstream.

Both builds run the same model, prompts and batch geometry, each in its own process (one libllama per
process), and every logit array is compared byte for byte.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .logits import Case, DumpSpec

DEFAULT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: "
    "rough winds do shake the darling buds of May, and summer's lease hath all too short a date.",
]
# one ubatch for the whole prompt, and an odd ubatch that splits it; both attention kernels
DEFAULT_CASES = [Case(512, 512, False), Case(512, 7, False), Case(512, 512, True), Case(64, 13, True)]


@dataclass
class Mismatch:
    key: str
    identical: bool
    shape: tuple
    max_abs_diff: float
    n_diff: int
    first_row: int | None = None  # the first row (prompt position or decode step) with a differing byte


def run_dump(build: str, spec: DumpSpec, workdir: Path, env: dict | None = None) -> dict[str, np.ndarray]:
    spec_file = workdir / "spec.json"
    spec_file.write_text(spec.to_json())
    out = workdir / f"logits-{build.replace('/', '_')}.npz"
    proc = subprocess.run([sys.executable, "-m", "ridgefill_gguf.logits", "--build", build,
                           "--spec", str(spec_file), "-o", str(out)],
                          env=dict(os.environ, PYTHONFAULTHANDLER="1", **(env or {})), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"logits dump on build '{build}' failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    with np.load(out) as data:
        return {k: data[k] for k in data.files}


def compare(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[Mismatch]:
    if a.keys() != b.keys():
        raise ValueError(f"the dumps hold different cases: {sorted(a.keys() ^ b.keys())}")
    rows = []
    for key in sorted(a):
        x, y = a[key], b[key]
        same = x.shape == y.shape and x.tobytes() == y.tobytes()
        if x.shape == y.shape and x.dtype.kind == "f" and x.size:
            diff = np.abs(x.astype(np.float64) - y.astype(np.float64))
            differs = x.view(np.uint32) != y.view(np.uint32)
            max_diff, n_diff = float(np.nanmax(diff)), int(np.count_nonzero(differs))
            first = int(np.argmax(differs.reshape(len(x), -1).any(1))) if n_diff else None
        else:
            max_diff, n_diff, first = (0.0, 0, None) if same else (float("inf"), -1, 0)
        rows.append(Mismatch(key, same, tuple(x.shape), max_diff, n_diff, first))
    return rows


def check(model: str | Path, prompts: list[str] | None = None, cases: list[Case] | None = None,
          builds: tuple[str, str] = ("upstream", "ridgefill"), n_ctx: int = 2048, decode_steps: int = 4,
          n_threads: int = 2, n_gpu_layers: int = 0, maps: str | Path | None = None) -> dict:
    spec = DumpSpec(model=str(model), prompts=prompts or DEFAULT_PROMPTS, cases=cases or DEFAULT_CASES,
                    n_ctx=n_ctx, n_threads=n_threads, decode_steps=decode_steps, n_gpu_layers=n_gpu_layers,
                    maps=str(maps) if maps else None)
    with tempfile.TemporaryDirectory() as tmp:
        dumps = [run_dump(b, spec, Path(tmp)) for b in builds]
    rows = compare(*dumps)
    return {
        "model": str(model),
        "maps": str(maps) if maps else None,
        "builds": list(builds),
        "identical": all(r.identical for r in rows),
        "n_arrays": len(rows),
        "n_logits": int(sum(np.prod(r.shape) for r in rows if not r.key.endswith("/tokens"))),
        "spec": json.loads(spec.to_json()),
        "arrays": [asdict(r) for r in rows],
    }


def markdown(report: dict) -> str:
    lines = [f"# Equivalence: {report['builds'][0]} vs {report['builds'][1]}", "",
             f"model: `{report['model']}`; {report['n_arrays']} arrays, {report['n_logits']} logits; "
             f"**{'byte-identical' if report['identical'] else 'DIFFERENT'}**", "",
             "| array | shape | identical | max abs diff | differing values |", "|---|---|---|---|---|"]
    for r in report["arrays"]:
        lines.append(f"| {r['key']} | {'x'.join(map(str, r['shape']))} | {'yes' if r['identical'] else 'NO'} "
                     f"| {r['max_abs_diff']:.3g} | {r['n_diff']} |")
    return "\n".join(lines) + "\n"
