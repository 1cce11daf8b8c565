"""`ridgefill-gguf eval report`: one study's runs (needles, nll and agreement over splits and tails) in one table
and across-split plots, for the docs.

It reads every `summary.json` below a folder, groups the runs by model, and writes `study.json`, `study.md` and
one PNG per model: ΔNLL on novel and key tokens, KL and top-1 agreement, and filled-region retrieval, each
against the split, one line per arm and tail. Beside the contrasts with exact it pairs arms with each other per
sample or document (the fitted map against the identity fill, a selector against its count-matched random rows),
from each run's per-sample files. A run in a folder named like another's plus "-TAG" (eval-study's claim runs: the
same prompts or documents with one setting changed) is paired per sample or document with that run.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from ..util import save_figure, write_atomic
from .agreement import summarize as summarize_agreement
from .documents import document_mean, load_jsonl
from .facts import TURNS as FACT_TURNS
from .facts import FactSample, paired_scores
from .needles import Sample
from .nll import summarize as summarize_nll
from .stats import bootstrap_mean, noninferiority

MARGIN = 0.02  # paper §3.4: non-inferiority to exact on filled-region retrieval, 2 points

# (arm, arm it is paired with): the fitted map against the identity fill and against no fill at the same split and
# tail; the default selector against its count-matched random rows, its identity-fill and question-blind twins,
# the attention selector and no selector
PAIRS = (("ridge", "identity"), ("ridge", "none"), ("ridge+probe", "ridge+random:probe"),
         ("ridge+probe", "identity+probe"), ("ridge+probe", "ridge+blind-probe"), ("ridge+probe", "ridge+attention"),
         ("ridge+probe", "ridge"))


def collect(root: str | Path) -> dict:
    """{model name: {"nll": [...], "agreement": [...], "needles": [...], and "facts": [...] where there are facts
    runs}}, each run's split, tail, summary and paired arm-against-arm contrasts."""
    runs: dict[str, dict[str, list]] = defaultdict(lambda: {"nll": [], "agreement": [], "needles": []})
    needle_files: dict[str, tuple[list[Sample], list[dict]]] = {}  # run folder -> samples, answers
    document_files: dict[str, list[dict]] = {}  # run folder -> per-document rows (nll, agreement)
    for path in sorted(Path(root).rglob("summary.json")):
        r = json.loads(path.read_text())
        name = Path(r["model"]).name
        kind = r.get("instrument", "").removeprefix("eval ")
        where = {"path": str(path.parent), "run": run_name(path.parent, root)}
        if kind in ("nll", "agreement"):
            docs = load_jsonl(path.parent / "documents.jsonl")
            document_files[str(path.parent)] = docs
            # from the per-document file, so every run is resampled the same way (within each domain)
            summary = (summarize_nll if kind == "nll" else summarize_agreement)(docs, list(r["summary"]))
            runs[name][kind].append({"split": r["split"], "tail": r["options"]["tail"], "documents": r["documents"],
                                     "summary": summary, "pairs": document_pairs(kind, docs),
                                     "selectors": r["options"].get("selectors"), **where})
        elif kind == "needles":
            samples = [Sample(**s) for s in load_jsonl(path.parent / "samples.jsonl")]
            answers = load_jsonl(path.parent / "results.jsonl")
            needle_files[str(path.parent)] = samples, answers
            for cfg, c in r["configs"].items():
                pairs, test = needle_contrasts(samples, answers, cfg, c["tail"])
                runs[name]["needles"].append({"split": c["split"], "tail": c["tail"], "groups": c["groups"],
                                              "pairs": pairs, "noninferiority": test,
                                              "lengths": r["options"]["lengths"], **where,
                                              "config": cfg})
        elif kind == "facts":
            samples = [FactSample(**s) for s in load_jsonl(path.parent / "samples.jsonl")]
            answers = load_jsonl(path.parent / "results.jsonl")
            for cfg, c in r["configs"].items():
                runs[name].setdefault("facts", []).append(
                    {"split": c["split"], "tail": c["tail"], "turns": fact_tests(samples, answers, cfg, c["tail"]),
                     "lengths": r["options"]["lengths"], "selectors": r.get("selectors"), **where,
                     "config": cfg})
    # a run in a folder BASE-TAG against the run in BASE: the same prompts or documents, one setting changed
    for model_runs in runs.values():
        for kind, kind_runs in model_runs.items():
            if kind == "facts":  # a facts run answers its own exact arm: each is paired within itself
                continue
            for x in kind_runs:
                if (found := tagged_base(x, kind_runs)) is None:
                    continue
                base, tag = found
                if kind == "needles":
                    samples, answers = needle_files[x["path"]]
                    x["pairs"].update(needle_run_pairs(samples, answers, x["config"], needle_files[base["path"]][1],
                                                       base["config"], x["tail"], tag))
                else:
                    x["pairs"].update(document_run_pairs(kind, document_files[x["path"]],
                                                         document_files[base["path"]], tag))
    return {k: v for k, v in runs.items()}


def run_name(folder: Path, root: str | Path) -> str:
    """A run's folder under the study's root, so two runs in folders of one name stay apart."""
    return folder.relative_to(root).as_posix() if folder != Path(root) else folder.name


def tagged_base(x: dict, runs: list[dict]) -> tuple[dict, str] | None:
    """(the run in folder "BASE" beside x's "BASE-TAG", at the same split and tail, and TAG), or None."""
    folder = Path(x["path"])
    bases = [b for b in runs if (b["split"], b["tail"]) == (x["split"], x["tail"]) and
             Path(b["path"]).parent == folder.parent and folder.name.startswith(Path(b["path"]).name + "-")]
    if not bases:
        return None
    base = max(bases, key=lambda b: len(Path(b["path"]).name))  # "a-b-c" pairs with "a-b" rather than "a"
    return base, folder.name.removeprefix(Path(base["path"]).name + "-")


def needle_run_pairs(samples: list[Sample], answers: list[dict], config: str, base_answers: list[dict],
                     base_config: str, tail: int, tag: str) -> dict:
    """Every arm of a tagged run against every arm of its base run (exact aside), per filled-region sample both
    answered: {"arm [TAG] - base arm": {"accuracy": bootstrap}}."""
    filled = sorted(s.sample_id for s in samples if s.filled_region(tail))
    task = {s.sample_id: s.task for s in samples}
    pairs = {}
    for a, sa in scores_by_arm(answers, config).items():
        for b, sb in scores_by_arm(base_answers, base_config).items():
            d, tasks = paired(sa, sb, filled, task)
            if d:
                pairs[f"{a} [{tag}] - {b}"] = {"accuracy": bootstrap_mean(d, strata=tasks)}
    return pairs


def scores_by_arm(answers: list[dict], config: str) -> dict[str, dict[str, float]]:
    """{arm: {sample: score}} for one configuration's answers."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for r in answers:
        if r["config"] == config:
            out[r["arm"]][r["sample"]] = r["score"]
    return out


def paired(a: dict[str, float], b: dict[str, float], ids: list[str], task: dict[str, str]) -> tuple[list, list]:
    """(a - b per sample of ids that both scored, in the order of ids; each one's task, the resampling stratum)."""
    both = [sid for sid in ids if sid in a and sid in b]
    return [a[sid] - b[sid] for sid in both], [task[sid] for sid in both]


def document_run_pairs(kind: str, docs: list[dict], base_docs: list[dict], tag: str) -> dict:
    """As document_pairs, between a tagged run and its base run: every arm of one against every arm of the other,
    per document both measured (the same documents give the same exact pass on one machine)."""
    field = DOCUMENT_FIELD[kind]
    base = {d["name"]: d for d in base_docs}
    rows = [(d, base[d["name"]]) for d in docs if d["name"] in base]
    out = {}
    for a in sorted({arm for d, _ in rows for arm in d[field]}):
        for b in sorted({arm for _, e in rows for arm in e[field]}):
            if (s := paired_documents(kind, rows, a, b)) is not None:
                out[f"{a} [{tag}] - {b}"] = s
    return out


DOCUMENT_FIELD = {"nll": "delta", "agreement": "arms"}  # where a per-document row keeps its arms
DOCUMENT_MEASURES = {"nll": ("all", "novel", "key"), "agreement": ("kl", "top1")}


def paired_documents(kind: str, rows: list[tuple[dict, dict]], a: str, b: str) -> dict | None:
    """{measure: bootstrap of arm a in the first row of each pair minus arm b in the second, within each domain}
    over the pairs where both arms were measured; None when there is none."""
    field = DOCUMENT_FIELD[kind]
    both = [(d, e) for d, e in rows if a in d[field] and b in e[field]]
    if not both:
        return None

    def diff(pair: tuple[dict, dict], k: str) -> float | None:
        x, y = pair[0][field][a][k], pair[1][field][b][k]
        return None if x is None or y is None else x - y

    # document_mean reads each row's name for its domain
    named = [{"name": d["name"], "pair": (d, e)} for d, e in both]
    return {k: document_mean(named, lambda r, k=k: diff(r["pair"], k)) for k in DOCUMENT_MEASURES[kind]}


def needle_contrasts(samples: list[Sample], answers: list[dict], config: str, tail: int) -> tuple[dict, dict]:
    """Over the filled-region samples of one configuration: ({"a - b": bootstrap of score(a) - score(b)} for the
    PAIRS both arms answered, {arm: paper §3.4's test of arm minus exact at the 2-point margin, with that Δ}),
    resampled within each task."""
    filled = [s.sample_id for s in samples if s.filled_region(tail)]
    task = {s.sample_id: s.task for s in samples}  # paper §3.4 resamples within each task
    exact = scores_by_arm(answers, "exact")["exact"]
    by_arm = scores_by_arm(answers, config)
    pairs = {}
    for a, b in PAIRS:
        d, tasks = paired(by_arm.get(a, {}), by_arm.get(b, {}), filled, task)
        if d:
            pairs[f"{a} - {b}"] = {"accuracy": bootstrap_mean(d, strata=tasks)}
    test = {}
    for arm, scores in sorted(by_arm.items()):
        d, tasks = paired(scores, exact, filled, task)
        # Δ with it, from the same files and resampling (a summary.json may predate the per-task resampling)
        test[arm] = {**noninferiority(d, MARGIN, strata=tasks), "delta": bootstrap_mean(d, strata=tasks)}
    return pairs, test


def fact_tests(samples: list[FactSample], answers: list[dict], config: str, tail: int) -> dict:
    """{turn: {arm: paper §3.4's test of arm minus exact at the 2-point margin, with that Δ}} over the samples whose
    asked fact lies before the tail, resampled within each domain."""
    by = {(a["sample"], a["config"], a["arm"]): a for a in answers}
    arms = sorted({a["arm"] for a in answers if a["config"] == config})
    out: dict = {}
    for turn, field, fact, _ in FACT_TURNS:
        for arm in arms:
            got, _, d = paired_scores(samples, by, config, arm, field, fact, tail)
            if not got:
                continue
            domains = [s.domain for s in got]
            out.setdefault(turn, {})[arm] = {**noninferiority(d, MARGIN, strata=domains),
                                             "delta": bootstrap_mean(d, strata=domains),
                                             "exact": sum(by[(s.sample_id, "exact", "exact")][field] for s in got)
                                             / len(got)}
    return out


def document_pairs(kind: str, docs: list[dict]) -> dict:
    """{"a - b": {measure: bootstrap of the per-document difference, within each domain}} for nll (ΔNLL on all,
    novel and key tokens) and agreement (KL and top-1)."""
    rows = [(d, d) for d in docs]
    return {f"{a} - {b}": s for a, b in PAIRS if (s := paired_documents(kind, rows, a, b)) is not None}


def _ci(s: dict, scale: float = 1.0, digits: int = 3, sign: bool = True) -> str:
    if not s or not s.get("n"):
        return "n/a"
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    return f"{f.format(scale * s['mean'])} [{f.format(scale * s['lo'])}, {f.format(scale * s['hi'])}]"


def markdown(study: dict) -> str:
    lines = ["# RidgeFill quality study", ""]
    for model, runs in study.items():
        lines += [f"## {model}", ""]
        if runs["needles"]:
            # a row per run and arm: selector runs list their own arms
            lines += ["Retrieval (needles), filled-region samples: accuracy % and Δ vs exact (paired, 95% interval); "
                      "the one-sided 95% lower bound of paper §3.4 (the bootstrap bound or the binomial floor "
                      f"-100(1-0.05^(1/n)), whichever is lower) against a {100 * MARGIN:.0f}-point margin:",
                      "", "| split | tail | samples (filled) | exact | arm | arm, filled | Δ vs exact | "
                      f"lower bound (floor) | within {100 * MARGIN:.0f} points | run |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
            for x in sorted(runs["needles"], key=lambda x: (x["tail"], x["split"])):
                g = x["groups"]["all tasks"]
                head = [str(x["split"]), str(x["tail"]), f"{g['samples']} ({g['filled_samples']})",
                        _pct(g["arms"]["exact"]["accuracy_filled"])]
                for arm, a in g["arms"].items():
                    if arm != "exact":
                        t = x.get("noninferiority", {}).get(arm)
                        test = ["n/a", "n/a"] if not t or not t["n"] else \
                            [f"{100 * t['bound']:+.1f} ({100 * t['floor']:+.1f})", "yes" if t["holds"] else "no"]
                        delta = (t or {}).get("delta") or a["delta_filled"]
                        lines.append("| " + " | ".join(head + [arm, _pct(a["accuracy_filled"]),
                                                                _ci(delta, 100, 1)] + test +
                                                         [x["run"]]) + " |")
            lines.append("")
        # the document instruments: a row per run and arm
        doc_tables = (("nll", "ΔNLL (arm minus exact, nats per token, mean over documents [95% interval]):",
                       ("all", "novel", "key"), lambda s, k: _ci(s[k])),
                      ("agreement", "Agreement along the exact greedy continuation (mean over documents [95% interval]):",
                       ("KL(exact ‖ arm)", "top-1 %"),
                       lambda s, k: _ci(s["kl"], 1, 4, False) if k.startswith("KL") else _ci(s["top1"], 100, 1, False)))
        for kind, title, columns, cell in doc_tables:
            if not runs[kind]:
                continue
            # the run's folder names its setting (a tagged run's budget, window or tail)
            lines += [title, "", "| split | tail | documents | arm | " + " | ".join(columns) + " | run |",
                      "|---|---|---|---|" + "---|" * (len(columns) + 1)]
            for x in sorted(runs[kind], key=lambda x: (x["tail"], x["split"], x["path"])):
                for arm, s in x["summary"].items():
                    lines.append(f"| {x['split']} | {x['tail']} | {x['documents']} | {arm} | " +
                                 " | ".join(cell(s, c) for c in columns) + f" | {x['run']} |")
            lines.append("")
        lines += facts_table(runs.get("facts", []))
        lines += pairs_table(runs)
    return "\n".join(lines)


def facts_table(runs: list[dict]) -> list[str]:
    """Facts asked in other words: a row per run, question and arm."""
    if not runs:
        return []
    lines = ["Facts asked in other words (eval facts), samples whose asked fact lies before the tail: exact %, Δ vs "
             "exact (paired, 95% interval, resampled within domains) and the lower bound against the margin; "
             "follow_up over the reused cache, follow_up_exact_only as --ridgefill-reuse exact-only serves it, "
             "follow_up_rerank as --ridgefill-reuse rerank does:", "",
             "| split | tail | question | samples | exact | arm | Δ vs exact | lower bound (floor) | "
             f"within {100 * MARGIN:.0f} points | run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in sorted(runs, key=lambda x: (x["tail"], x["split"])):
        for turn, arms in x["turns"].items():
            for arm, t in arms.items():
                lines.append(f"| {x['split']} | {x['tail']} | {turn} | {t['n']} | {_pct(t['exact'])} | {arm} | "
                             f"{_ci(t['delta'], 100, 1)} | {100 * t['bound']:+.1f} ({100 * t['floor']:+.1f}) | "
                             f"{'yes' if t['holds'] else 'no'} | {x['run']} |")
    return lines + [""]


def pairs_table(runs: dict) -> list[str]:
    """Arms paired with each other per sample or document: Δ = first arm minus second [95% interval]."""
    rows = []
    for x in sorted(runs["needles"], key=lambda x: (x["tail"], x["split"])):
        for pair, s in x["pairs"].items():
            rows.append([x["split"], x["tail"], pair, "needles", f"{s['accuracy']['n']} samples",
                         "retrieval " + _ci(s["accuracy"], 100, 1) + " points", x["run"]])
    for kind in ("nll", "agreement"):
        for x in sorted(runs[kind], key=lambda x: (x["tail"], x["split"])):
            for pair, s in x["pairs"].items():
                if kind == "nll":
                    value = "; ".join(f"{k} {_ci(s[k])}" for k in ("all", "novel", "key"))
                else:
                    value = f"KL {_ci(s['kl'], 1, 4)}; top-1 {_ci(s['top1'], 100, 1)} points"
                rows.append([x["split"], x["tail"], pair, kind, f"{s[next(iter(s))]['n']} documents", value,
                             x["run"]])
    if not rows:
        return []
    return (["Arms paired with each other (Δ = first arm minus second, per sample or document, mean [95% interval]; "
             "retrieval on filled-region samples, ΔNLL in nats per token):", "",
             "| split | tail | arms | instrument | paired over | Δ | run |", "|---|---|---|---|---|---|---|"] +
            ["| " + " | ".join(map(str, r)) + " |" for r in rows] + [""])


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def plot(model: str, runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("nll", "novel", "ΔNLL, novel tokens"), ("nll", "key", "ΔNLL, key tokens"),
              ("agreement", "kl", "KL(exact ‖ arm)"), ("needles", None, "filled-region retrieval (%)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for ax, (kind, key, title) in zip(axes, panels):
        series = defaultdict(list)
        for x in runs[kind]:
            if kind == "needles":
                for arm, a in x["groups"]["all tasks"]["arms"].items():
                    # one point per arm, tail and split (a selector run repeats exact and ridge)
                    if a["accuracy_filled"] is not None and \
                            x["split"] not in {p[0] for p in series[(arm, x["tail"])]}:
                        series[(arm, x["tail"])].append((x["split"], 100 * a["accuracy_filled"], None, None))
            else:
                for arm, s in x["summary"].items():
                    v = s[key]
                    if v.get("n"):
                        series[(arm, x["tail"])].append((x["split"], v["mean"], v["lo"], v["hi"]))
        for (arm, tail), pts in sorted(series.items()):
            pts.sort()
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            line = ax.plot(xs, ys, marker="o", ls="--" if arm == "exact" else "-", label=f"{arm}, T{tail}")[0]
            if pts[0][2] is not None:
                ax.fill_between(xs, [p[2] for p in pts], [p[3] for p in pts], color=line.get_color(), alpha=0.15)
        splits = sorted({p[0] for pts in series.values() for p in pts})
        if splits:
            ax.set_xticks(splits)
        ax.set_xlabel("split")
        ax.set_title(title)
        if kind != "needles":
            ax.axhline(0, color="k", lw=0.6)
        if series:
            ax.legend(fontsize=7)
    fig.suptitle(model)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def run_report(root: str | Path, out_dir: str | Path) -> dict:
    study = collect(root)
    if not study:
        raise ValueError(f"no eval results (summary.json) below {root}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "study.json", json.dumps(study, indent=2) + "\n")
    write_atomic(out_dir / "study.md", markdown(study))
    for model, runs in study.items():
        try:
            plot(model, runs, out_dir / f"study-{Path(model).stem}.png")
        except ImportError:
            break
    return study
