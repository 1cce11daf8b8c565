"""`ridgefill-gguf eval agreement`: how closely each arm follows the exact model after its prefill.

Per document (its first `max_tokens` tokens as the prompt): the exact arm prefills stock and continues greedily
for `continue_tokens` steps. Each RidgeFill arm prefills the same prompt, then is fed the exact continuation
step by step (every step runs the full model, as decoding does). At each step: KL(exact || arm) of the next-token
distributions, and whether the arm's top-1 token is the exact one. Per document the means over steps; over
documents a bootstrap interval. Results are appended per document, so an interrupted run resumes.
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



@dataclass
class AgreementOptions(DocumentOptions):
    arms: tuple[str, ...] = ("ridge", "identity")
    continue_tokens: int = 256


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def kl_and_top1(exact_logits: np.ndarray, arm_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: KL(exact || arm) in nats, and whether the arm's top-1 token equals exact's."""
    p, q = log_softmax(exact_logits), log_softmax(arm_logits)
    kl = (np.exp(p) * (p - q)).sum(axis=-1)
    return kl, exact_logits.argmax(axis=-1) == arm_logits.argmax(axis=-1)


def run_agreement(model: str | Path, maps: str | Path, docs: list[str | Path], out_dir: str | Path,
                  opts: AgreementOptions, log: Callable[[str], None] = print) -> dict:
    from .. import libs
    from ..engine.session import Session
    from ..gguf_io import read_gguf

    arms = parse_arms(opts.arms, follows=True)  # the arms are fed the continuation through decode steps
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows_path = out_dir / "documents.jsonl"
    done = {r["doc_id"]: r for r in load_jsonl(rows_path)}
    if done:
        log(f"eval agreement: resuming, {len(done)} documents done")
    split = int(read_gguf(maps).get("ridgefill.split"))
    libs.use_build("ridgefill")
    sess = Session(model, n_ctx=opts.max_tokens + opts.continue_tokens + 16, n_batch=512, n_ubatch=512,
                   flash_attn=opts.flash_attn, n_threads=opts.threads, n_gpu_layers=opts.n_gpu_layers, maps=maps)
    t0, n_new = time.perf_counter(), 0
    try:
        for doc, prompt in long_documents(docs, sess.tokenize, opts, done, log, "eval agreement"):
            logits, _ = sess.stock(prompt)
            cont, exact = sess.follow(logits, len(prompt), opts.continue_tokens)
            row = {"doc_id": doc.doc_id, "name": doc.name, "tokens": len(prompt), "steps": len(cont), "arms": {}}
            def prefill(arm, params):
                logits, _, st = sess.ridgefill(prompt, tail=opts.tail, min_prefix=0, **params)
                if not st["applied"]:
                    raise RuntimeError(f"{doc.name}: RidgeFill did not apply: {st['reason']}")
                _, forced = sess.follow(logits, len(prompt), len(cont), tokens=cont)
                kl, top1 = kl_and_top1(exact, forced)
                row["arms"][arm.name] = {"kl": float(kl.mean()), "top1": float(top1.mean()),
                                         "first_disagreement": int(np.argmin(top1)) if not top1.all() else None,
                                         "rows": {k: st[k] for k in ROW_COUNTS if k in st}}
                return st

            run_arms(arms, len(prompt), opts.tail, opts.selectors, prefill)
            append_jsonl(rows_path, row)
            done[doc.doc_id] = row
            n_new += 1
            log(f"eval agreement: document {len(done)} ({Path(doc.name).name}, {len(prompt)} tokens, {len(cont)} "
                "steps): " + ", ".join(f"{a} KL {row['arms'][a]['kl']:.4f} top-1 {100 * row['arms'][a]['top1']:.1f}%"
                                       for a in opts.arms) +
                f"; {(time.perf_counter() - t0) / n_new:.0f} s per document")
    finally:
        sess.close()
    rows = list(done.values())
    summary = summarize(rows, opts.arms)
    result = {"instrument": "eval agreement", "date": dt.date.today().isoformat(), "hardware": hardware(),
              "model": str(model), "maps": str(maps), "split": split, "options": asdict(opts),
              "documents": len(rows), "summary": summary}
    write_summary(out_dir, result, markdown(result, rows), plot)
    return result


def summarize(rows: list[dict], arms) -> dict:
    """Per arm: mean KL and top-1 agreement over documents, resampled within each domain."""
    return {arm: {k: document_mean(rows, lambda r: r["arms"][arm][k]) for k in ("kl", "top1")} for arm in arms}


def markdown(result: dict, rows: list[dict]) -> str:
    o = result["options"]

    def fmt(s: dict, scale: float = 1.0, digits: int = 4) -> str:
        if not s["n"]:
            return "n/a"
        return (f"{scale * s['mean']:.{digits}f} [{scale * s['lo']:.{digits}f}, {scale * s['hi']:.{digits}f}] "
                f"(median {scale * s['median']:.{digits}f})")

    lines = [f"# Agreement with exact: {Path(result['model']).name}, split {result['split']}, tail {o['tail']}", "",
             f"{result['date']}; {result['documents']} documents of {o['min_tokens']}-{o['max_tokens']} tokens; the "
             f"exact greedy continuation ({o['continue_tokens']} tokens) fed to each arm; mean over documents "
             "[95% bootstrap interval] (median)", "",
             "| arm | KL(exact ‖ arm), nats per token | top-1 agreement, % |", "|---|---|---|"]
    for arm, s in result["summary"].items():
        lines.append(f"| {arm} | {fmt(s['kl'])} | {fmt(s['top1'], 100, 1)} |")
    lines += ["", "| document | tokens | steps | " + " | ".join(f"{a} KL / top-1" for a in o["arms"]) + " |",
              "|---|---|---|" + "---|" * len(o["arms"])]
    for r in rows:
        lines.append(f"| {Path(r['name']).name} | {r['tokens']} | {r['steps']} | " +
                     " | ".join(f"{r['arms'][a]['kl']:.4f} / {100 * r['arms'][a]['top1']:.1f}%" for a in o["arms"])
                     + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(result["summary"])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.8))
    for axis, key, scale, label in ((ax, "kl", 1, "KL(exact ‖ arm), nats/token"), (bx, "top1", 100, "top-1 agreement (%)")):
        ss = [result["summary"][a][key] for a in arms]
        ys = [scale * s["mean"] for s in ss]
        err = [[scale * (s["mean"] - s["lo"]) for s in ss], [scale * (s["hi"] - s["mean"]) for s in ss]]
        axis.bar(range(len(arms)), ys, yerr=err, capsize=4)
        axis.set_xticks(range(len(arms)), arms)
        axis.set_ylabel(label)
    fig.suptitle(f"{Path(result['model']).name}, split {result['split']}, tail {result['options']['tail']}")
    fig.tight_layout()
    save_figure(fig, path)
