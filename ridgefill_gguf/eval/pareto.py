"""`ridgefill-gguf eval pareto`: the trade, swept. Speed from `bench` runs (the probe at several budget factors
beside plain RidgeFill, at one or more lengths) against quality from an `eval report` study (tagged runs of the
same settings), joined by configuration: tail, probe rows and budget factor (plain RidgeFill is budget 0). Speed
and quality may come from different models (the 8B shape's time on the GPU, the small real models' retrieval):
the join is by settings, and the plot has a panel per quality model and measure. Retrieval is in points (higher is
better, its bound the one-sided 95% lower one); key-token ΔNLL in nats per token (lower is better, its bound the
95% upper end)."""
from __future__ import annotations

import json
from pathlib import Path

from ..util import save_figure, write_atomic

SERVER_BUDGET = 1.0  # a bench row without budget_factor (made before bench read it from /props) ran at 1
LOSS = "key-token ΔNLL"  # the measure whose lower values are better


def speed_points(bench: dict) -> dict[tuple, dict[int, float]]:
    """{(tail, probe rows, budget factor): {tokens: speedup over exact}} from one bench result (resident rows)."""
    out: dict[tuple, dict[int, float]] = {}
    tail = bench["tail"]
    for row in bench["rows"]:
        if row["placement"] == "resident":
            out.setdefault((tail, 0, 0.0), {})[row["tokens"]] = row["speedup"]
    for x in bench.get("selectors") or []:
        if x["placement"] == "resident" and x["selector"].partition("@")[0] == "probe":
            budget = SERVER_BUDGET if x.get("budget_factor") is None else x["budget_factor"]
            out.setdefault((tail, x["probe_rows"], budget), {})[x["tokens"]] = x["speedup_vs_exact"]
    return out


def quality_points(model_curves: dict) -> dict[tuple, dict[tuple, dict]]:
    """{(tail, probe rows, budget factor): {(split, measure): test entry}} for one model's curves (advise's form):
    measures "needles", "facts first" / "facts follow_up" / ... where there are facts runs, and the key tokens' loss
    where there are nll runs (its "bound" the interval's upper end). Probe runs other than the default in more than
    budget and probe rows are left out; of several runs, the one with the most samples."""
    from ..advise import ARMS, default_like

    out: dict[tuple, dict[tuple, dict]] = {}
    entries = [("needles", e) for e in model_curves.get("needles", [])] + \
              [(f"facts {e['turn']}", e) for e in model_curves.get("facts", [])] + \
              [(LOSS, {**e, "bound": e["hi"]}) for e in model_curves.get("nll", [])]
    for measure, e in entries:
        if e["arm"] not in ARMS or not default_like(e, free=("budget", "probe_rows")):
            continue
        key = (e["tail"], 0, 0.0) if ARMS[e["arm"]] is None else \
            (e["tail"], e["probe"]["probe_rows"], float(e["probe"]["budget"]))
        best = out.setdefault(key, {}).get((e["split"], measure))
        if best is None or e["n"] > best["n"]:
            out[key][(e["split"], measure)] = e
    return out


def frontier(points: list[dict], lower_is_better: bool = False) -> None:
    """Mark each point on the Pareto frontier: no other point is at least as fast and at least as good, and better
    in one (quality: the mean difference from exact)."""
    sign = -1 if lower_is_better else 1
    for p in points:
        p["frontier"] = not any(q is not p and q["speedup"] >= p["speedup"] and sign * q["mean"] >= sign * p["mean"]
                                and (q["speedup"] > p["speedup"] or sign * q["mean"] > sign * p["mean"])
                                for q in points)


def run_pareto(benches: list[Path], curves: dict, out_dir: Path) -> dict:
    """Join every bench with every model's curves; write pareto.json, pareto.md and pareto.png under out_dir.
    Benches of one model and split are one sweep: their configurations share its panels (each speedup against its
    own run's exact; of a configuration two benches timed, the first named)."""
    sweeps: dict[str, dict] = {}
    for b in benches:
        bench = json.loads(Path(b).read_text())
        speed_from = f"{Path(bench.get('model', b)).name}, split {bench.get('split', '?')}"
        sweep = sweeps.setdefault(speed_from, {})
        for key, by_tokens in speed_points(bench).items():
            for n, speedup in by_tokens.items():
                sweep.setdefault(key, {}).setdefault(n, speedup)
    panels = []
    for speed_from, speed in sweeps.items():
        for model, c in curves.items():
            panels += join(speed, quality_points(c), model, speed_from)
    if not panels:
        raise ValueError("no two configurations have both a speed (bench) and a quality (study) measurement: the "
                         "join is by tail, probe rows and budget factor")
    result = {"instrument": "eval pareto", "benches": [str(b) for b in benches], "panels": panels}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "pareto.json", json.dumps(result, indent=1) + "\n")
    write_atomic(out_dir / "pareto.md", markdown(result))
    plot(result, out_dir / "pareto.png")
    return result


def join(speed: dict[tuple, dict[int, float]], quality: dict[tuple, dict[tuple, dict]], model: str,
         speed_from: str) -> list[dict]:
    """A panel per quality split, measure and bench length with at least two configurations measured both ways."""
    panels = []
    for split, measure in sorted({m for q in quality.values() for m in q}):
        for n in sorted({n for by_n in speed.values() for n in by_n}):
            pts = [{"tail": k[0], "probe_rows": k[1], "budget": k[2], "speedup": speed[k][n],
                    **{f: quality[k][(split, measure)][f] for f in ("n", "mean", "bound")},
                    "run": quality[k][(split, measure)]["run"]}
                   for k in sorted(speed) if n in speed[k] and (split, measure) in quality.get(k, {})]
            if len(pts) > 1:
                frontier(pts, lower_is_better=measure == LOSS)
                panels.append({"model": model, "split": split, "measure": measure, "tokens": n,
                               "speed_from": speed_from, "points": pts})
    return panels


def label(p: dict) -> str:
    return "plain" if p["budget"] == 0 else f"probe {p['probe_rows']}, budget {p['budget']:g}"


def markdown(r: dict) -> str:
    lines = ["# The trade: speed against quality per configuration", "",
             "Speed: time to first token over exact (bench, resident maps); quality: difference from exact, points "
             "(mean, with the one-sided 95% lower bound), on the filled region; key-token ΔNLL: nats per token over "
             "held-out documents (mean, with the 95% upper end; lower is better). * = on the Pareto frontier.", ""]
    for p in r["panels"]:
        loss = p["measure"] == LOSS
        lines += [f"## {p['model']}, split {p['split']}: {p['measure']}; speed of {p['speed_from']} at "
                  f"{p['tokens']:,} tokens", "",
                  f"| tail | configuration | speedup | {'ΔNLL (upper)' if loss else 'Δ vs exact (bound)'} | "
                  f"{'documents' if loss else 'samples'} | frontier | run |",
                  "|---|---|---|---|---|---|---|"]
        for x in sorted(p["points"], key=lambda x: -x["speedup"]):
            q = f"{x['mean']:+.3f} ({x['bound']:+.3f})" if loss else f"{100 * x['mean']:+.1f} ({100 * x['bound']:+.1f})"
            lines.append(f"| {x['tail']} | {label(x)} | {x['speedup']:.2f}x | {q} | {x['n']} | "
                         f"{'*' if x['frontier'] else ''} | {x['run']} |")
        lines.append("")
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = r["panels"]
    cols = min(len(panels), 4)  # a grid, so that many panels stay readable
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, p in zip(axes.flat, panels):
        loss = p["measure"] == LOSS
        scale = 1 if loss else 100
        for x in p["points"]:
            worst = scale * abs(x["mean"] - x["bound"])
            ax.errorbar(x["speedup"], scale * x["mean"], yerr=[[0], [worst]] if loss else [[worst], [0]], fmt="o",
                        color="C3" if x["frontier"] else "C0", capsize=3)
            ax.annotate(label(x), (x["speedup"], scale * x["mean"]), fontsize=7, xytext=(4, 4),
                        textcoords="offset points")
        front = sorted((x for x in p["points"] if x["frontier"]), key=lambda x: x["speedup"])
        ax.plot([x["speedup"] for x in front], [scale * x["mean"] for x in front], color="C3", lw=0.8)
        ax.axhline(0, color="k", lw=0.6)
        if not loss:
            ax.axhline(-2, color="k", lw=0.6, ls=":")  # the 2-point margin
        ax.set_xlabel(f"speedup at {p['tokens']:,} tokens ({p['speed_from']})", fontsize=8)
        ax.set_ylabel("ΔNLL, key tokens (nats)" if loss else "Δ vs exact (points)")
        ax.set_title(f"{Path(p['model']).stem} S{p['split']}: {p['measure']}", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
