#!/usr/bin/env python3
"""Gzip the large per-sample files of committed eval runs, unpack them, or copy a study to continue its runs.

The checkout travels to the GPU machine with every call (64 MiB with a model's piece), and the per-sample answers
of the studies were most of it; gzipped they take about an eighth. The eval instruments and `eval report` read
PATH.gz as PATH (ridgefill_gguf/eval/documents.py, jsonl_lines). The gzip header carries no time or name here, so
one Python packs the same rows to the same bytes.

  python3 tools/pack_results.py [--min-kb 200] DIR...     results, samples and documents .jsonl over the size
  python3 tools/pack_results.py --unpack DIR...           back to .jsonl (rows appended since kept after them)
  python3 tools/pack_results.py --copy-unpacked SRC DEST  SRC's files into DEST, unpacked; a file in DEST stays
"""
from __future__ import annotations

import argparse
import gzip
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ridgefill_gguf.eval.documents import jsonl_lines  # noqa: E402
from ridgefill_gguf.util import write_atomic  # noqa: E402

NAMES = ("results.jsonl", "samples.jsonl", "documents.jsonl")


def rows_of(path: Path) -> bytes:
    """PATH.gz's rows and PATH's, as the instruments read them, as one .jsonl text."""
    return "".join(line + "\n" for line in jsonl_lines(path)).encode()


def pack(path: Path) -> None:
    # a cut between the two steps leaves both files, which jsonl_lines reads as one
    write_atomic(path.with_name(path.name + ".gz"), gzip.compress(rows_of(path), compresslevel=9, mtime=0))
    path.unlink(missing_ok=True)


def unpack(path: Path) -> None:
    write_atomic(path, rows_of(path))
    path.with_name(path.name + ".gz").unlink(missing_ok=True)


def create_if_absent(path: Path, data: bytes) -> bool:
    """Write path unless it exists, atomically: os.link never replaces a file that a run may be appending to."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def copy_unpacked(src: Path, dest: Path) -> int:
    """As `cp -rn SRC/. DEST/` with the packed files unpacked (jobs side by side may copy one study at once)."""
    copied = 0
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = f.relative_to(src)
        if f.name.endswith(".jsonl.gz"):
            plain = f.with_name(f.name.removesuffix(".gz"))
            copied += create_if_absent(dest / rel.with_name(plain.name), rows_of(plain))
        elif not f.with_name(f.name + ".gz").exists():  # a packed file's appended rows go with it
            copied += create_if_absent(dest / rel, f.read_bytes())
    return copied


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--min-kb", type=int, default=200, help="pack only files at least this large")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--unpack", action="store_true")
    mode.add_argument("--copy-unpacked", action="store_true", help="DIRS are SRC and DEST")
    args = ap.parse_args(argv)
    if args.copy_unpacked and len(args.dirs) != 2:
        print("pack_results: --copy-unpacked takes SRC and DEST", file=sys.stderr)
        return 2
    read = args.dirs[:1] if args.copy_unpacked else args.dirs  # DEST may not exist yet
    if missing := [d for d in read if not d.is_dir()]:
        print(f"pack_results: {missing[0]} is not a folder", file=sys.stderr)
        return 2
    if args.copy_unpacked:
        print(f"copied {copy_unpacked(*args.dirs)} files into {args.dirs[1]}")
        return 0
    for d in args.dirs:
        for name in NAMES:
            if args.unpack:
                for gz in sorted(d.rglob(name + ".gz")):
                    unpack(gz.with_name(name))
                    print(f"unpacked {gz.with_name(name)}")
            else:
                for path in sorted(d.rglob(name)):
                    if (size := path.stat().st_size) >= 1024 * args.min_kb:
                        pack(path)
                        print(f"packed {path}: {size} -> {path.with_name(name + '.gz').stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
