"""advise: which split, tail and exact-row selector to serve a model with, for a quality margin the user names.

Quality comes from the committed studies (`eval report`'s study.json, condensed into data/quality.json by
tools/quality_curves.py): per model, split, tail and arm, the filled-region retrieval difference from exact and its
one-sided 95% lower bound. Speed comes from a short measurement on this machine (`bench` through llama-server at a
modest length, plain RidgeFill and the default selector), carried to the length the user serves by the MAC ceiling:
the share of its ceiling a configuration reached here, times its ceiling there."""
from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .bench import mac_ceiling
from .eval.facts import TURNS as FACT_TURNS
from .eval.needles import TASKS as NEEDLE_TASKS
from .random_gguf import ModelShape

PACKAGED = Path(__file__).parent / "data" / "quality.json"
# the arms advise chooses among, as eval names them, with the selector a request names
ARMS = {"ridge": None, "ridge+probe": "probe"}
# the default selector's settings; a committed run made with others says nothing about the default
DEFAULT_PROBE = {"budget": 1.0, "whole_numbers": True, "probe_rows": 256, "probe_share": None}


@dataclass
class Candidate:
    split: int
    tail: int
    arm: str
    budget: float | None = None   # the probe's budget factor (None: plain RidgeFill)
    reuse: str = "any"            # how a follow-up is served: over the reused cache, or prefilled again (RESUMED)
    quality: dict | None = None   # needles: n, mean, bound, floor (fractions), run
    facts: dict = field(default_factory=dict)  # eval facts per question: the same fields
    loss: dict | None = None      # eval nll: the key tokens' ΔNLL against exact (shown, not chosen on)
    speed: dict | None = None     # measured here and carried to the served length
    notes: list[str] = field(default_factory=list)


def signature(model) -> dict:
    """What identifies a model's weights well enough to reuse another run's quality: its name and shape."""
    from .gguf_io import read_gguf

    s = ModelShape.from_gguf(model)
    name = read_gguf(model).get("general.name")
    return {"file": Path(model).name, "name": name, "arch": s.arch, "n_layer": s.n_layer, "n_embd": s.n_embd}


# --- the committed quality -------------------------------------------------------------------------------------

def run_settings(run_dir: Path) -> tuple[dict | None, list[str] | None]:
    """The selector settings and needle tasks a needles run used, from its summary (None where it does not say). A
    run from before whole numbers existed ran without them."""
    path = run_dir / "summary.json"
    if not path.exists():
        raise ValueError(f"the study names the run {run_dir}, whose summary.json is not there: run this from where "
                         "eval report ran, or beside the study's runs")
    opts = json.loads(path.read_text()).get("options") or {}
    sel = opts.get("selectors")
    return (None if sel is None else probe_fields(sel)), opts.get("tasks")


def probe_fields(sel: dict) -> dict:
    """The settings that make a probe the default one (whole numbers did not exist before they were a setting)."""
    return {**{k: sel.get(k) for k in DEFAULT_PROBE}, "whole_numbers": sel.get("whole_numbers", False)}


def condensed_test(t: dict) -> dict:
    """A non-inferiority test, condensed: samples, mean Δ and its upper end, the bound and the binomial floor
    (fractions)."""
    return {"n": t["n"], "mean": round(t["delta"]["mean"], 6), "hi": round(t["delta"]["hi"], 6),
            "bound": round(t["bound"], 6), "floor": round(t["floor"], 6)}


def condensed_loss(measures: dict) -> dict:
    """An arm's loss against exact, condensed: documents, and the key tokens' mean ΔNLL and its 95% interval (nats
    per token; above zero is worse), beside all tokens' mean."""
    key = measures["key"]
    return {"n": key["n"], "mean": round(key["mean"], 6), "lo": round(key["lo"], 6), "hi": round(key["hi"], 6),
            "all_mean": round(measures["all"]["mean"], 6)}


def run_folder(path: str, roots: list[Path]) -> Path:
    """A run's folder as a study names it, under the first root that has it."""
    return next((r / path for r in roots if (r / path).exists()), roots[0] / path)


def curves_from_reports(reports: list[Path], root: Path, signatures: dict[str, dict]) -> dict:
    """{model file: {"signature": ..., "needles": [entry], "facts": [entry], "nll": [entry]}} from eval report
    study.json files; an entry is one (split, tail, arm) of one run (and a question, for facts): its non-inferiority
    test, or for nll its key-token loss, with the probe's settings read from the run (its path from root, or from
    beside the study)."""
    out: dict = {}
    for report in reports:
        roots = [root, Path(report).resolve().parent.parent]
        for model, study in json.loads(Path(report).read_text()).items():
            m = out.setdefault(model, {"signature": signatures.get(model), "needles": [], "facts": [], "nll": []})
            for run in study.get("nll", []):
                sel = run.get("selectors")
                settings = probe_fields(sel) if sel else run_settings(run_folder(run["path"], roots))[0]
                for arm, measures in sorted(run["summary"].items()):
                    m["nll"].append({"split": run["split"], "tail": run["tail"], "arm": arm,
                                     "probe": settings if ARMS.get(arm) else None, **condensed_loss(measures),
                                     "run": run["path"]})
            for run in study.get("needles", []):
                settings, tasks = run_settings(run_folder(run["path"], roots))
                for arm, ni in sorted(run.get("noninferiority", {}).items()):
                    m["needles"].append({"split": run["split"], "tail": run["tail"], "arm": arm,
                                         "probe": settings if ARMS.get(arm) else None, "tasks": tasks,
                                         "lengths": run["lengths"], **condensed_test(ni), "run": run["path"]})
            for run in study.get("facts", []):
                settings = probe_fields(run.get("selectors") or {})
                for turn, arms in run["turns"].items():
                    for arm, t in sorted(arms.items()):
                        m["facts"].append({"split": run["split"], "tail": run["tail"], "arm": arm, "turn": turn,
                                           "probe": settings if ARMS.get(arm) else None, "lengths": run["lengths"],
                                           **condensed_test(t), "run": run["path"]})
    for m in out.values():
        for kind in ("needles", "facts", "nll"):
            m[kind].sort(key=lambda e: (e["split"], e["tail"], e["arm"], e.get("turn", ""), e["run"]))
    return out


def load_curves(path: Path = PACKAGED) -> dict:
    return json.loads(Path(path).read_text())


def curves_of_file(path: Path) -> dict:
    """The models' curves from a quality.json, or from an eval report's study.json (its runs' paths as the report
    wrote them, from here)."""
    data = json.loads(Path(path).read_text())
    return data["models"] if "models" in data else curves_from_reports([Path(path)], Path.cwd(), {})


def curves_for(curves: dict, sig: dict) -> tuple[str | None, list[dict], list[dict], list[dict]]:
    """The committed needles, facts and nll entries of the model with this signature: matched by shape and name, or
    by file name."""
    for model, c in curves.items():
        s = c.get("signature") or {}
        same_shape = s and all(s.get(k) == sig[k] for k in ("arch", "n_layer", "n_embd", "name"))
        if same_shape or model == sig["file"]:
            return model, c["needles"], c.get("facts", []), c.get("nll", [])
    return None, [], [], []


def default_like(e: dict, free: tuple[str, ...] = ()) -> bool:
    """Whether an entry speaks for the default selector (all four needle tasks; the probe's default settings but
    for those named free); plain RidgeFill has no settings."""
    probe_ok = ARMS.get(e["arm"]) is None or (e["probe"] is not None and all(
        e["probe"].get(k) == v for k, v in DEFAULT_PROBE.items() if k not in free))
    return probe_ok and e.get("tasks", list(NEEDLE_TASKS)) == list(NEEDLE_TASKS)


def budget_of(e: dict) -> float | None:
    return None if ARMS.get(e["arm"]) is None or e["probe"] is None else e["probe"].get("budget")


def quality_of(entries: list[dict], split: int, tail: int, arm: str, turn: str | None = None,
               budget: float = 1.0) -> dict | None:
    """The committed quality of one configuration with the default selector's settings but for the budget factor
    (needles: over all four tasks; facts: of one question): the run with the most samples."""
    ok = [e for e in entries if (e["split"], e["tail"], e["arm"], e.get("turn")) == (split, tail, arm, turn)
          and default_like(e, free=("budget",)) and budget_of(e) in (None, budget)]
    return max(ok, key=lambda e: e["n"], default=None)


def needles_at(entries: list[dict], split: int, tail: int, arm: str, budget: float | None) -> dict | None:
    """The needles test of a configuration; for a larger budget without a run of its own, the default budget's
    run, marked: the probe ranks the rows the same way and keeps more of them, a superset of those exact rows."""
    q = quality_of(entries, split, tail, arm, budget=budget or 1.0)
    if q is None and budget and budget > 1.0 and (base := quality_of(entries, split, tail, arm)):
        q = {**base, "from_budget": 1.0}
    return q


def facts_of(entries: list[dict], split: int, tail: int, arm: str, budget: float | None = None) -> dict:
    """{question: the committed eval facts test} of one configuration (the follow-up as llama-server serves it by
    default, over the reused cache, and under exact-only and rerank reuse)."""
    return {t[0]: q for t in FACT_TURNS if (q := quality_of(entries, split, tail, arm, t[0], budget or 1.0))}


def committed_budgets(entries: list[dict]) -> list[float]:
    """The probe's budget factors the committed studies measured (any split and tail), the default among them."""
    return sorted({1.0} | {b for e in entries if e["arm"] == "ridge+probe" and default_like(e, free=("budget",))
                           and (b := budget_of(e)) is not None})


def within(q: dict, margin: float) -> bool | None:
    """Whether a test holds the margin (its bound above minus the margin, as eval report decides); False too when
    even the interval's upper end lies below; None when it has too few samples to tell (its binomial floor lies
    below)."""
    if q["bound"] > -margin:
        return True
    return False if q["floor"] > -margin or q["hi"] < -margin else None


# --- speed -----------------------------------------------------------------------------------------------------

def ceiling_at(shape: ModelShape, split: int, tail: int, tokens: int, measured: dict) -> float:
    """The MAC ceiling of a configuration at `tokens`, its exact rows keeping the share of the prefix they had when
    measured; a windowed model's skipped fills are not counted."""
    prefix = max(tokens - tail, 1)
    exact = int(round(measured["exact_share"] * prefix))
    return mac_ceiling(shape, tokens, split, prefix - exact, exact + tail, tail, n_probe=measured.get("probe_rows", 0))


def carried_speed(shape: ModelShape, split: int, tail: int, tokens: int, measured: dict) -> dict:
    """A configuration's speedup at `tokens`: the measured speedup times its ceiling there over its ceiling at the
    measured length, both counted the same way (its share of the ceiling stays)."""
    here = ceiling_at(shape, split, tail, measured["tokens"], measured)
    there = ceiling_at(shape, split, tail, tokens, measured)
    return {"tokens": tokens, "ceiling_macs": round(there, 4),
            "speedup": round(measured["speedup"] * there / here, 3)}


def measured_speeds(bench: dict) -> dict[tuple[str, float | None], dict]:
    """{(arm, budget factor): what the bench measured} for plain RidgeFill and the probe at each budget it timed
    ("probe" at the server's default budget, "probe@1.5" at 1.5)."""
    row = bench["rows"][0]
    out = {("ridge", None): {"tokens": row["tokens"], "speedup": row["speedup"],
                             "share_of_ceiling": row["share_of_ceiling"], "exact_share": 0.0,
                             "ms": row["median_ridgefill_ms"], "stock_ms": row["median_exact_ms"]}}
    for s in bench.get("selectors") or []:
        name, _, budget = s["selector"].partition("@")
        if name == "probe":
            # the factor the bench recorded (the server's default for a bare "probe"), else the one it named
            factor = s.get("budget_factor") or (float(budget) if budget else 1.0)
            out[("ridge+probe", float(factor))] = {
                "tokens": row["tokens"], "speedup": s["speedup_vs_exact"], "share_of_ceiling": s["share_of_ceiling"],
                "exact_share": s["selected"] / s["prefix"], "probe_rows": s["probe_rows"], "ms": s["median_ms"],
                "stock_ms": row["median_exact_ms"]}
    return out


# --- the advice ------------------------------------------------------------------------------------------------

# the follow-up question each reuse policy serves: over the reused cache, or a RidgeFill prefill resumed from the
# held split state that ranks the rows for the new question (--ridgefill-reuse exact-only), keeping exact those the
# first prefill ran exactly (rerank)
FOLLOW_UP_OF = {"any": "follow_up", "exact-only": "follow_up_exact_only", "rerank": "follow_up_rerank"}
RESUMED = ("exact-only", "rerank")
SERVER_REUSE = "exact-only"  # llama-server's --ridgefill-reuse
NO_FOLLOW_UP = f"no follow-up measured for this configuration: the server's default reuse ({SERVER_REUSE})"
CHEAPER_FOLLOW_UP = ("rerank", "exact-only", "any")  # of equals, the last: rerank keeps more rows exact


def holds(c: Candidate, margin: float) -> bool:
    """Whether a candidate's committed quality holds the margin: the needles' bound, and each natural question it
    serves (the first and its follow-up) where a run has the samples to test it."""
    served = ("first", FOLLOW_UP_OF[c.reuse])
    return bool(c.quality and within(c.quality, margin)) and all(
        within(q, margin) is not False for t, q in c.facts.items() if t in served)


def choose(candidates: list[Candidate], margin: float) -> tuple[Candidate | None, str]:
    """The fastest configuration (at the served length) whose committed quality holds the margin and that is faster
    than the stock prefill there (of equals, the one whose follow-ups cost least: over the reused cache, then
    exact-only); else None and why."""
    ok = [c for c in candidates if holds(c, margin)]
    faster = [c for c in ok if c.speed["at_tokens"]["speedup"] > 1.0]
    if faster:
        return max(faster, key=lambda c: (c.speed["at_tokens"]["speedup"], CHEAPER_FOLLOW_UP.index(c.reuse))), ""
    if ok:
        return None, ("the configurations within the margin are not faster than the stock prefill at this length "
                      "on this machine: serve the stock prefill")
    if not any(c.quality for c in candidates):
        return None, ("no committed retrieval (eval needles) of this model at these splits and tails, so nothing can "
                      "be held to the margin (a key-token loss, where one is shown, is not a retrieval bound): "
                      "serve the stock prefill, or measure this model's quality (eval needles, eval facts, eval "
                      "report) and ask again with --quality")
    return None, ("no configuration's committed quality holds the margin on every question measured (the needles, "
                  "and facts asked in other words: the first question and the follow-up its reuse policy serves): "
                  "serve the stock prefill, or measure this model's quality (eval needles, eval facts, eval report) "
                  "and ask again with --quality")


def candidates_of(split: int, tail: int, arm: str, budget: float | None, entries: list[dict],
                  fact_entries: list[dict], nll_entries: list[dict]) -> list[Candidate]:
    """One measured configuration as served under each reuse policy a run measured its follow-ups with; where none
    did, under the server's default policy, which prefills a follow-up again for its own question (an unmeasured
    follow-up over the reused cache would pass the margin unseen)."""
    facts = facts_of(fact_entries, split, tail, arm, budget)
    policies = tuple(p for p in FOLLOW_UP_OF if FOLLOW_UP_OF[p] in facts)
    unmeasured = not policies
    policies = policies or (SERVER_REUSE,)
    loss = quality_of(nll_entries, split, tail, arm, budget=budget or 1.0)
    out = [Candidate(split, tail, arm, budget, reuse, needles_at(entries, split, tail, arm, budget), facts, loss)
           for reuse in policies]
    for c in out:
        if unmeasured:
            c.notes.append(NO_FOLLOW_UP)
        if c.quality is None:
            c.notes.append("no committed retrieval for this configuration")
        elif c.quality.get("from_budget"):
            c.notes.append("needles from the default budget's run: a larger budget keeps a superset of its exact rows")
        if c.reuse in RESUMED:
            c.notes.append("each follow-up is prefilled again with RidgeFill, resumed from the held split state" +
                           (", the rows the first prefill ran exactly kept exact" if c.reuse == "rerank" else ""))
    return out


def advise(model, maps: list, *, tokens: int, margin: float, tails: tuple[int, ...], measure_tokens: int,
           curves: dict, out_dir: Path, threads: int | None = None, n_gpu_layers: int | None = None,
           measure: Callable | None = None, log: Callable[[str], None] = print) -> dict:
    """Measure each maps file's split at each tail here (plain RidgeFill, and the probe at every budget factor the
    committed studies measured), join the committed quality, choose, and write advice.json and advice.md under
    out_dir. measure(maps, tail) -> a bench result (tests pass their own)."""
    from .bench import run_bench
    from .gguf_io import read_gguf
    from .util import hardware, write_atomic

    if min(tails) < 1 or measure_tokens < max(tails) + 512 or tokens <= max(tails):
        raise ValueError(f"--measure-tokens ({measure_tokens}) must exceed the largest tail ({max(tails)}) by 512 "
                         f"and --tokens ({tokens}) must exceed it, so that a prefix is left to fill")
    out_dir = Path(out_dir)
    sig = signature(model)
    shape = ModelShape.from_gguf(model)
    matched, entries, fact_entries, nll_entries = curves_for(curves, sig)
    if matched is None:
        log(f"advise: no committed quality for {sig['file']} ({sig['name']}, {sig['arch']}, {sig['n_layer']} "
            "layers): the speeds below are measured, the quality is not; measure it with eval needles and eval facts")
    selectors = tuple(f"probe@{b:g}" for b in committed_budgets(entries + fact_entries))
    measure = measure or (lambda m, t: run_bench(
        model, m, [measure_tokens], tail=t, repeats=1, selectors=selectors, threads=threads,
        n_gpu_layers=n_gpu_layers, out_dir=out_dir / "bench", label=f"{Path(m).stem}-T{t}", log=log))
    candidates = []
    for m in maps:
        split = int(read_gguf(m).get("ridgefill.split"))
        for tail in tails:
            log(f"advise: measuring split {split}, tail {tail} at {measure_tokens} tokens")
            for (arm, budget), sp in measured_speeds(measure(m, tail)).items():
                speed = {"measured": sp, "at_tokens": carried_speed(shape, split, tail, tokens, sp)}
                for c in candidates_of(split, tail, arm, budget, entries, fact_entries, nll_entries):
                    c.speed = speed
                    candidates.append(c)
    best, why_none = choose(candidates, margin)
    result = {"instrument": "advise", "date": dt.date.today().isoformat(), "hardware": hardware(),
              "model": sig, "quality_from": matched, "tokens": tokens, "margin": margin,
              "measure_tokens": measure_tokens, "candidates": [c.__dict__ for c in candidates],
              "choice": best.__dict__ if best else None, "why_none": why_none}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "advice.json", json.dumps(result, indent=1) + "\n")
    write_atomic(out_dir / "advice.md", markdown(result))
    return result


def bound_cell(q: dict | None) -> str:
    return "not measured" if q is None else f"{100 * q['mean']:+.1f} ({100 * q['bound']:+.1f}), {q['n']}"


def loss_cell(q: dict | None) -> str:
    return "not measured" if q is None else f"{q['mean']:+.3f} ({q['hi']:+.3f}), {q['n']}"


def verdict(q: dict | None, margin: float) -> str:
    return "n/a" if q is None else {True: "yes", False: "no", None: "too few to test"}[within(q, margin)]


def flags(c: dict) -> str:
    """The llama-server flags that serve a candidate (the maps file carries the split), each named even where it is
    the server's default, since the defaults have changed before."""
    budget = f" --ridgefill-budget {c['budget']:g}" if c.get("budget") is not None else ""
    return (f"--ridgefill-tail {c['tail']} --ridgefill-select {ARMS[c['arm']] or 'none'}{budget} "
            f"--ridgefill-reuse {c.get('reuse', 'any')}")


def facts_said(c: dict) -> str:
    """The chosen configuration's natural-question tests, as the advice states them."""
    said = [f"{name} {100 * q['mean']:+.1f} (bound {100 * q['bound']:+.1f})"
            for name, t in (("first question", "first"), ("follow-up", FOLLOW_UP_OF[c.get("reuse", "any")]))
            if (q := c["facts"].get(t))]
    loss = c.get("loss")
    return ("; facts asked in other words: " + ", ".join(said) if said else "") + (
        f"; key tokens' loss {loss['mean']:+.3f} nats per token (95% upper {loss['hi']:+.3f}) in `{loss['run']}`"
        if loss else "")


def markdown(r: dict) -> str:
    m = r["model"]
    lines = [f"# RidgeFill advice: {m['file']}", "",
             f"{r['date']}; {r['hardware'].get('gpu') or r['hardware'].get('cpu', '')}. Served length {r['tokens']:,} "
             f"tokens; quality margin {100 * r['margin']:.0f} points of filled-region retrieval (the one-sided 95% "
             f"lower bound of the committed study must stay above minus the margin). Speed measured here at "
             f"{r['measure_tokens']:,} tokens through llama-server and carried to {r['tokens']:,} by the share of "
             "the MAC ceiling reached here.",
             "", f"Quality from: {r['quality_from'] or 'no committed study of this model'} (RULER-style needles, "
             "whose questions repeat the needle's words, so the lexical net helps; questions in other words: "
             "docs/eval.md, eval facts).", "",
             "Follow-ups `any` reuse the cache the first request left; `exact-only` prefills the conversation "
             "again for the new question, resumed from the held split state (`--ridgefill-reuse exact-only`); "
             "`rerank` does too and keeps exact the rows the first prefill ran exactly (`--ridgefill-reuse rerank`). "
             "Facts in other words: the first question and the follow-up that policy serves. Key-token ΔNLL: eval "
             "nll's loss on the key tokens of held-out documents against exact (nats per token), shown beside: the "
             "margin is in retrieval points.", "",
             "| split | tail | arm | budget | follow-ups | measured speedup | MAC ceiling share | estimated speedup at "
             "length | needles: retrieval Δ (bound), samples | within margin | facts in other words: first / "
             "follow-up | key-token ΔNLL (95% upper), documents |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in r["candidates"]:
        q, sp = c["quality"], c["speed"]
        served = ("first", FOLLOW_UP_OF[c.get("reuse", "any")])
        lines.append(f"| {c['split']} | {c['tail']} | {c['arm']} | {'' if c.get('budget') is None else c['budget']} "
                     f"| {c.get('reuse', 'any')} | {sp['measured']['speedup']:.2f}x | "
                     f"{100 * sp['measured']['share_of_ceiling']:.0f}% | {sp['at_tokens']['speedup']:.2f}x | "
                     f"{bound_cell(q)}{' (budget 1)' if q and q.get('from_budget') else ''} | "
                     f"{verdict(q, r['margin'])} | " +
                     " / ".join(bound_cell(c["facts"].get(t)) + f" {verdict(c['facts'].get(t), r['margin'])}"
                                for t in served) + f" | {loss_cell(c.get('loss'))} |")
    ch = r["choice"]
    lines += ["", "**Advice:** " + (
        f"split {ch['split']} (its maps file), `{flags(ch)}`: about {ch['speed']['at_tokens']['speedup']:.2f}x at "
        f"{r['tokens']:,} tokens, needle retrieval {100 * ch['quality']['mean']:+.1f} points (bound "
        f"{100 * ch['quality']['bound']:+.1f}) in `{ch['quality']['run']}`" + facts_said(ch) + "." +
        (f" ({NO_FOLLOW_UP[0].upper()}{NO_FOLLOW_UP[1:]}.)" if NO_FOLLOW_UP in ch["notes"] else "")
        if ch else r["why_none"] + ".")]
    return "\n".join(lines) + "\n"
