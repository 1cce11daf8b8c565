"""What the document-based instruments (nll, agreement) share: options, resumable results, long documents."""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ..fit.capture import Document, iter_documents, text_files
from ..util import write_atomic
from .arms import SelectorOptions
from .stats import bootstrap_mean


@dataclass
class DocumentOptions:
    arms: tuple[str, ...] = ("ridge", "identity", "none")
    tail: int = 1024
    min_tokens: int = 4096
    max_tokens: int = 8192
    max_docs: int | None = None
    threads: int | None = None
    n_gpu_layers: int = 0
    flash_attn: bool = True
    selectors: SelectorOptions = field(default_factory=SelectorOptions)  # for fill+selector arms


def write_summary(out_dir: Path, result: dict, markdown: str, plot: Callable[[dict, Path], None]) -> None:
    """summary.json, summary.md and (where matplotlib is installed) summary.png of an instrument's run."""
    write_atomic(out_dir / "summary.json", json.dumps(result, indent=2) + "\n")
    write_atomic(out_dir / "summary.md", markdown)
    try:
        plot(result, out_dir / "summary.png")
    except ImportError:
        pass


def jsonl_parts(path: Path) -> list[Path]:
    """Where a per-sample file's rows are: PATH.gz (a committed run's, packed by tools/pack_results.py to keep the
    checkout small enough to travel to the GPU machine), then PATH (rows appended since)."""
    return [p for p in (path.with_name(path.name + ".gz"), path) if p.exists()]


def jsonl_lines(path: Path) -> list[str]:
    """A per-sample file's lines: PATH.gz's, then those of PATH that are not among them (a packed run copied beside
    its unpacked self, or a pack cut between its two writes, counts once)."""
    lines: list[str] = []
    for part in jsonl_parts(path):
        if part.suffix == ".gz":
            lines = gzip.decompress(part.read_bytes()).decode().splitlines()
        else:
            packed = set(lines)
            lines += [line for line in part.read_text().splitlines() if line not in packed]
    return [line for line in lines if line.strip()]


def load_jsonl(path: Path) -> list[dict]:
    """The rows a run appended so far (none when it has not started)."""
    return [json.loads(line) for line in jsonl_lines(path)]


def refuse_packed(out_dir: Path) -> None:
    """A run that writes its sample list whole cannot continue a packed one (its list would be read twice)."""
    if packed := sorted(p.name for p in out_dir.glob("*.jsonl.gz")):
        raise ValueError(f"{out_dir} holds a packed run ({', '.join(packed)}): unpack it before continuing it "
                         f"(python3 tools/pack_results.py --unpack {out_dir})")


def domain(name: str) -> str:
    """A document's domain: the folder it sits in (the corpus keeps one folder per domain); paper §3.4 resamples
    documents within each."""
    return Path(name).parent.name


def document_mean(rows: list[dict], value: Callable[[dict], float | None]) -> dict:
    """bootstrap_mean of value(row) over the per-document rows that have one, resampled within each domain."""
    kept = [(v, domain(r["name"])) for r in rows if (v := value(r)) is not None]
    return bootstrap_mean([v for v, _ in kept], strata=[d for _, d in kept])


def append_jsonl(path: Path, row: dict) -> None:
    # one write(2) with O_APPEND: runs side by side (eval needles --shard) append whole lines to one file
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)


def across_domains(docs: list[str | Path]) -> list[Path]:
    """The text files with the domains taken in turn (each domain's files in their order), so that max_docs
    samples every domain rather than the first folders."""
    by_domain: dict[str, list[Path]] = {}
    for f in text_files(docs):
        by_domain.setdefault(domain(str(f)), []).append(f)
    queues = list(by_domain.values())
    return [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]


def long_documents(docs: list[str | Path], tokenize: Callable[[str], list[int]], opts: DocumentOptions,
                   done: dict, log: Callable[[str], None], what: str) -> Iterator[tuple[Document, list[int]]]:
    """(document, its first max_tokens tokens) for each document not done yet and at least min_tokens long,
    until max_docs are done, the domains in turn."""
    for doc in iter_documents(across_domains(docs)):
        if opts.max_docs is not None and len(done) >= opts.max_docs:
            return
        if doc.doc_id in done:
            continue
        tokens = tokenize(doc.text)[:opts.max_tokens]
        if len(tokens) < opts.min_tokens:
            log(f"{what}: skip {Path(doc.name).name}: {len(tokens)} tokens < {opts.min_tokens}")
            continue
        yield doc, tokens
