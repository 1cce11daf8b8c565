"""`ridgefill-gguf eval nll`: loss on the last tokens of long documents under each arm, against exact.

Per document (its first `max_tokens` tokens): the last `score` tokens are scored. Exact loss comes from a stock
prefill; each RidgeFill arm's from the prefill's own logits (the logits_rows parameter), so `none`
hides the filled rows from the scored rows as the method defines it. Novel tokens lie inside no 8-token run
seen earlier in the document; key tokens lose more than 2 nats when the context is cut to the last `tail`
tokens before the scored block (a second stock prefill). ΔNLL = arm minus exact, per document (mean over its
tokens of a kind), then over documents with a paired bootstrap interval. Results are appended per document,
so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import datetime as dt
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..util import hardware, save_figure
from .arms import ROW_COUNTS, parse_arms, run_arms
from .documents import DocumentOptions, append_jsonl, document_mean, load_jsonl, long_documents, write_summary
from .tokens import key_mask, novel_mask, token_nll

ARMS = ("ridge", "identity", "none")
KINDS = ("all", "novel", "key")


@dataclass
class NllOptions(DocumentOptions):
    score: int = 512
    n_ctx: int | None = None


def doc_result(doc_id: str, name: str, tokens: list[int], nll: dict[str, np.ndarray], cut: np.ndarray,
               score: int) -> dict:
    """One document's paired contrasts: per arm and token kind, the mean ΔNLL and the token count."""
    start = len(tokens) - score
    masks = {"all": np.ones(score, bool), "novel": novel_mask(tokens, start),
             "key": key_mask(nll["exact"], cut)}
    out = {"doc_id": doc_id, "name": name, "tokens": len(tokens),
           "counts": {k: int(m.sum()) for k, m in masks.items()},
           "exact_nll": {k: float(nll["exact"][m].mean()) if m.any() else None for k, m in masks.items()},
           "delta": {}}
    for arm, values in nll.items():
        if arm == "exact":
            continue
        d = values - nll["exact"]
        out["delta"][arm] = {k: float(d[m].mean()) if m.any() else None for k, m in masks.items()}
    return out


def summarize(rows: list[dict], arms) -> dict:
    """Per arm and token kind: the mean ΔNLL over documents, resampled within each domain."""
    return {arm: {k: document_mean(rows, lambda r: r["delta"][arm][k]) for k in KINDS} for arm in arms}


def run_nll(model: str | Path, maps: str | Path, docs: list[str | Path], out_dir: str | Path, opts: NllOptions,
            log: Callable[[str], None] = print) -> dict:
    from .. import libs
    from ..engine.session import Session
    from ..gguf_io import read_gguf

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows_path = out_dir / "documents.jsonl"
    done = {r["doc_id"]: r for r in load_jsonl(rows_path)}
    if done:
        log(f"eval nll: resuming, {len(done)} documents done")
    if opts.score > opts.tail:
        raise ValueError(f"--score {opts.score} must not exceed --tail {opts.tail}: the scored rows are tail rows")
    split = int(read_gguf(maps).get("ridgefill.split"))
    arms = parse_arms(opts.arms)
    libs.use_build("ridgefill")
    sess = Session(model, n_ctx=opts.n_ctx or opts.max_tokens + 16, n_batch=512, n_ubatch=512,
                   flash_attn=opts.flash_attn, n_threads=opts.threads, n_gpu_layers=opts.n_gpu_layers, maps=maps)
    bos = sess.tokenize("", add_bos=True)
    t0, n_new = time.perf_counter(), 0
    try:
        for doc, tokens in long_documents(docs, sess.tokenize, opts, done, log, "eval nll"):
            targets = tokens[-opts.score:]
            nll = {"exact": token_nll(sess.stock_rows(tokens, opts.score + 1)[:-1], targets)}
            # the context cut to the last `tail` tokens before the scored block (BOS kept, as the model expects)
            cut_tokens = bos + tokens[-(opts.score + opts.tail):]
            cut = token_nll(sess.stock_rows(cut_tokens, opts.score + 1)[:-1], targets)
            def prefill(arm, params):
                logits, st = sess.ridgefill_rows(tokens, opts.score + 1, tail=opts.tail, min_prefix=0, **params)
                nll[arm.name] = token_nll(logits[:-1], targets)
                return st

            stats = run_arms(arms, len(tokens), opts.tail, opts.selectors, prefill)
            row = doc_result(doc.doc_id, doc.name, tokens, nll, cut, opts.score)
            row["rows"] = {arm: {k: st[k] for k in ROW_COUNTS if k in st} for arm, st in stats.items()}
            append_jsonl(rows_path, row)
            done[doc.doc_id] = row
            n_new += 1
            rate = (time.perf_counter() - t0) / n_new
            log(f"eval nll: document {len(done)} ({Path(doc.name).name}, {len(tokens)} tokens): " +
                ", ".join(f"{a} ΔNLL {row['delta'][a]['all']:+.4f} (novel {row['delta'][a]['novel'] or 0:+.4f})"
                          for a in opts.arms) + f"; {rate:.0f} s per document")
    finally:
        sess.close()
    rows = list(done.values())
    result = {"instrument": "eval nll", "date": dt.date.today().isoformat(), "hardware": hardware(),
              "model": str(model), "maps": str(maps), "split": split, "options": asdict(opts),
              "documents": len(rows), "summary": summarize(rows, opts.arms)}
    write_summary(out_dir, result, markdown(result, rows), plot)
    return result


def _fmt(s: dict) -> str:
    if not s["n"]:
        return "n/a"
    return f"{s['mean']:+.4f} [{s['lo']:+.4f}, {s['hi']:+.4f}] (median {s['median']:+.4f})"


def markdown(result: dict, rows: list[dict]) -> str:
    o = result["options"]
    lines = [f"# ΔNLL against exact: {Path(result['model']).name}, split {result['split']}, tail {o['tail']}", "",
             f"{result['date']}; {result['documents']} documents of {o['min_tokens']}-{o['max_tokens']} tokens; "
             f"the last {o['score']} tokens scored; mean over documents [95% bootstrap interval] (median)", "",
             "| arm | all tokens | novel tokens | key tokens |", "|---|---|---|---|"]
    for arm, s in result["summary"].items():
        lines.append(f"| {arm} | " + " | ".join(_fmt(s[k]) for k in KINDS) + " |")
    lines += ["", "| document | tokens | novel / key tokens | exact NLL | " +
              " | ".join(f"{a} ΔNLL" for a in o["arms"]) + " |", "|---|---|---|---|" + "---|" * len(o["arms"])]
    for r in rows:
        lines.append(f"| {Path(r['name']).name} | {r['tokens']} | {r['counts']['novel']} / {r['counts']['key']} | "
                     f"{r['exact_nll']['all']:.3f} | " +
                     " | ".join(f"{r['delta'][a]['all']:+.4f}" for a in o["arms"]) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(result["summary"])
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(KINDS)
    for k, kind in enumerate(KINDS):
        xs, ys, err = [], [], [[], []]
        for i, arm in enumerate(arms):
            s = result["summary"][arm][kind]
            if s["n"]:
                xs.append(i + (k - 1) * width)
                ys.append(s["mean"])
                err[0].append(s["mean"] - s["lo"])
                err[1].append(s["hi"] - s["mean"])
        ax.bar(xs, ys, width, yerr=err, capsize=3, label=f"{kind} tokens")
    ax.set_xticks(range(len(arms)), arms)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_ylabel("ΔNLL vs exact (nats/token)")
    ax.set_title(f"{Path(result['model']).name}, split {result['split']}, tail {result['options']['tail']}")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
