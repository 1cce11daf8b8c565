#!/usr/bin/env python3
"""Gzip the large per-sample files of committed eval runs, or unpack them to continue a run.

The checkout travels to the GPU machine with every call (64 MiB with a model's piece), and the per-sample answers
of the studies are most of it; gzipped they take a fifteenth. The eval instruments and `eval report` read
PATH.gz as PATH (ridgefill_gguf/eval/documents.py, load_jsonl). gzip's header carries no time or name here, so
packing the same rows twice gives the same bytes.

  python3 tools/pack_results.py [--min-kb 200] DIR...     results, samples and documents .jsonl over the size
  python3 tools/pack_results.py --unpack DIR...           back to .jsonl (rows appended since kept after them)
"""
from __future__ import annotations

import argparse
import gzip
import os
import sys
from pathlib import Path

NAMES = ("results.jsonl", "samples.jsonl", "documents.jsonl")


def write_atomic_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def rows_of(path: Path) -> bytes:
    """PATH.gz's rows, then PATH's (a run may have appended after packing), as one .jsonl text; a row in both (a
    committed run copied over the machine's copy of it) once."""
    packed, plain = path.with_name(path.name + ".gz"), path
    data = gzip.decompress(packed.read_bytes()) if packed.exists() else b""
    rows = (data + (plain.read_bytes() if plain.exists() else b"")).splitlines(keepends=True)
    return b"".join(dict.fromkeys(r if r.endswith(b"\n") else r + b"\n" for r in rows if r.strip()))


def pack(path: Path) -> int:
    data = rows_of(path)
    write_atomic_bytes(path.with_name(path.name + ".gz"), gzip.compress(data, compresslevel=9, mtime=0))
    path.unlink(missing_ok=True)
    return len(data)


def unpack(path: Path) -> int:
    data = rows_of(path)
    write_atomic_bytes(path, data)
    path.with_name(path.name + ".gz").unlink()
    return len(data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--min-kb", type=int, default=200, help="pack only files at least this large")
    ap.add_argument("--unpack", action="store_true")
    args = ap.parse_args(argv)
    for d in args.dirs:
        if not d.is_dir():
            print(f"pack_results: {d} is not a folder", file=sys.stderr)
            return 2
        for name in NAMES:
            if args.unpack:
                for gz in sorted(d.rglob(name + ".gz")):
                    path = gz.with_name(name)
                    print(f"unpacked {path} ({unpack(path)} bytes)")
            else:
                for path in sorted(d.rglob(name)):
                    if path.stat().st_size >= 1024 * args.min_kb:
                        rows = pack(path)
                        print(f"packed {path}: {rows} -> {path.with_name(name + '.gz').stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
