"""`ridgefill-gguf fit`: capture, sums, ridge solves over a λ grid, held-out scores, maps GGUF and a report."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..maps import format as fmt
from ..maps.convert import encode
from ..maps.state_delta import measure_state_deltas, write_state_deltas
from ..reference_hybrid import ARCHS as HYBRID_REFERENCE_ARCHS
from ..util import save_figure, write_atomic
from .capture import Capturer, iter_documents, sums_device
from .score import CacheProjector, LayerScore, score_layer
from .solve import DEFAULT_LAMBDAS, solve
from .sums import CaptureState, SplitSums

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen35", "qwen3next", "gemma3")


class FitError(ValueError):
    pass


@dataclass
class FitOptions:
    splits: list[int]
    lambdas: tuple[float, ...] = DEFAULT_LAMBDAS
    stride: int = 1
    max_doc_tokens: int = 4096
    max_rows: int | None = None
    heldout_rows: int = 4096
    n_batch: int = 512
    n_threads: int | None = None
    n_gpu_layers: int = 0
    outtype: str = "q8_0"
    tail_default: int = 1024
    checkpoint_every_s: float = 60.0
    layer_range: tuple[int, int] | None = None  # fit only these late layers (a group, to bound memory)
    state_correction: bool = False  # hybrids: measure the terminal-state offsets on the held-out text
    state_every: int = 2048         #   from the states every this many rows

    def late_layers(self, split: int, n_layer: int) -> list[int]:
        lo, hi = self.layer_range or (0, n_layer - 1)
        return [layer for layer in range(split + 1, n_layer) if lo <= layer <= hi]


@dataclass
class HeldOut:
    """Rows of the held-out text kept for scoring: x_S and every later layer's input."""
    x: dict[int, np.ndarray] = field(default_factory=dict)          # split -> [n, d]
    y: dict[int, dict[int, np.ndarray]] = field(default_factory=dict)  # split -> layer -> [n, d]

    def save(self, path: Path) -> None:
        arrays = {f"x/{s}": v for s, v in self.x.items()}
        arrays.update({f"y/{s}/{l}": v for s, ys in self.y.items() for l, v in ys.items()})
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "HeldOut":
        h = cls()
        with np.load(path) as data:
            for key in data.files:
                parts = key.split("/")
                if parts[0] == "x":
                    h.x[int(parts[1])] = data[key]
                else:
                    h.y.setdefault(int(parts[1]), {})[int(parts[2])] = data[key]
        return h


def available_memory() -> int | None:
    try:
        return next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return None


def check_memory(d: int, n_layer: int, splits: list[int], avail: int | None = None,
                 opts: FitOptions | None = None) -> int:
    opts = opts or FitOptions(splits=splits)
    need = sum(SplitSums.bytes_needed(d, d, len(opts.late_layers(s, n_layer))) for s in splits)
    avail = available_memory() if avail is None else avail
    if avail is not None and need > 0.7 * avail:
        raise FitError(f"the sums need {need / 2**30:.1f} GiB for splits {splits} (d={d}), and only "
                       f"{avail / 2**30:.1f} GiB is available: fit one --split per pass, and the late layers in "
                       "groups (--layers A-B, one pass each), then join the files with `ridgefill-gguf merge`")
    return need


def capture_calibration(cap: Capturer, docs, state: CaptureState, opts: FitOptions, sums_path: Path | None,
                        log: Callable[[str], None]) -> None:
    t0, last_save, tokens0 = time.perf_counter(), time.perf_counter(), state.tokens
    done = set(state.done_docs)
    for i, doc in enumerate(docs, start=1):
        if doc.doc_id in done:
            continue
        rows_so_far = min(ss.n for ss in state.splits.values())
        if opts.max_rows is not None and rows_so_far >= opts.max_rows:
            log(f"fit: reached --max-rows {opts.max_rows}")
            break
        tokens = cap.tokenize(doc.text, opts.max_doc_tokens)
        state.count_tokens(tokens, cap.llm.n_vocab())
        got = cap.capture(tokens, opts.splits, opts.stride, device=sums_device())
        for split, rows in got.splits.items():
            state.splits[split].add(rows.x, rows.ys)
        for split, reasons in got.excluded.items():
            total = state.excluded_rows.setdefault(str(split), {})
            for reason, n in reasons.items():
                total[reason] = total.get(reason, 0) + n
        state.tokens += got.n_tokens
        state.done_docs.append(doc.doc_id)
        rate = (state.tokens - tokens0) / max(time.perf_counter() - t0, 1e-9)
        log(f"fit: calibration document {i} ({Path(doc.name).name}): {got.n_tokens} tokens; "
            f"{state.tokens} tokens, {min(ss.n for ss in state.splits.values())} rows so far, {rate:.0f} tokens/s")
        if sums_path and time.perf_counter() - last_save > opts.checkpoint_every_s:
            state.save(sums_path)
            last_save = time.perf_counter()
    if sums_path:
        state.save(sums_path)


def capture_heldout(cap: Capturer, docs, opts: FitOptions, log) -> HeldOut:
    h = HeldOut()
    parts = {s: ([], {}) for s in opts.splits}
    n = 0
    for doc in docs:
        if n >= opts.heldout_rows:
            break
        tokens = cap.tokenize(doc.text, opts.max_doc_tokens)
        got = cap.capture(tokens, opts.splits, stride=1)
        take = min(opts.heldout_rows - n, min(len(r.x) for r in got.splits.values()))
        for s, rows in got.splits.items():
            parts[s][0].append(rows.x[:take])
            for layer, y in rows.ys.items():
                parts[s][1].setdefault(layer, []).append(y[:take])
        n += take
        log(f"fit: held-out document {Path(doc.name).name}: {take} rows kept ({n}/{opts.heldout_rows})")
    for s, (xs, ys) in parts.items():
        h.x[s] = np.concatenate(xs)
        h.y[s] = {layer: np.concatenate(v) for layer, v in ys.items()}
    return h


def evaluate(ss: SplitSums, heldout: HeldOut, proj: CacheProjector, lambdas, log) -> dict:
    """Scores per λ and per layer, the identity's scores, the chosen λ (best mean cache cosine) and its maps."""
    x = heldout.x[ss.split]
    ident = {layer: score_layer(proj, layer, x, heldout.y[ss.split][layer]) for layer in ss.layers}
    grid, best, best_mean, best_solution = {}, None, -np.inf, None
    for lam in lambdas:
        sol = solve(ss, lam)
        scores = {layer: score_layer(proj, layer, x @ s.weight.T + s.bias, heldout.y[ss.split][layer])
                  for layer, s in sol.items()}
        grid[lam] = scores
        mean = float(np.mean([s.cache_cos for s in scores.values()]))
        log(f"fit: split {ss.split}, lambda {lam:.4g}: mean cache cosine {mean:.4f}")
        if mean > best_mean:  # the first of equal scores wins, as max() would pick
            best, best_mean, best_solution = lam, mean, sol
    return {"grid": grid, "identity": ident, "best": best, "solution": best_solution}


def corpus_sha256(doc_ids: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(doc_ids)).encode()).hexdigest()


def output_path(out: Path, split: int, n_splits: int) -> Path:
    return out if n_splits == 1 else out.with_name(f"{out.stem}.S{split}{out.suffix}")


def write_split_maps(out: Path, model_fp: fmt.ModelFingerprint, ss: SplitSums, lam: float, state: CaptureState,
                     opts: FitOptions, force: bool, solution: dict | None = None) -> Path:
    """Maps at λ, with the calibration text's token frequencies (rf_token_freq) when the sums counted them;
    `solution` is that λ's solve when the caller has it already."""
    sol = solution or solve(ss, lam)
    qtype = fmt.WEIGHT_TYPES[opts.outtype]
    meta = fmt.MapsMeta(architecture=model_fp.architecture, split=ss.split, layers=ss.layers, lam=lam,
                        tail_default=opts.tail_default, name=f"RidgeFill maps, split {ss.split}",
                        fit_rows=ss.n, fit_corpus_sha256=corpus_sha256(state.done_docs),
                        model_n_layer=model_fp.n_layer, model_n_embd=model_fp.n_embd,
                        model_vocab_sha256=model_fp.vocab_sha256)
    plans = [fmt.LayerPlan(layer, ss.d_in, ss.d_out, qtype) for layer in ss.layers]

    def produce(plan):
        s = sol[plan.layer]
        return fmt.LayerMap(plan.layer, encode(s.weight, qtype), qtype, plan.d_in, s.bias)

    return fmt.write_maps(out, meta, plans, produce, token_freq=state.token_freq(), force=force)


def validate(model_fp: fmt.ModelFingerprint, calib: list, heldout: list, opts: FitOptions) -> None:
    if opts.state_correction and not model_fp.recurrent_layers:
        raise FitError(f"--state-correction: '{model_fp.architecture}' has no recurrent layers to correct")
    if opts.state_correction and model_fp.architecture not in HYBRID_REFERENCE_ARCHS:
        raise FitError(f"--state-correction: the offsets' NumPy measurement knows {', '.join(HYBRID_REFERENCE_ARCHS)}, "
                       f"not '{model_fp.architecture}'")
    if model_fp.architecture not in SUPPORTED_ARCHS:
        raise FitError(f"architecture '{model_fp.architecture}' is not supported (supported: "
                       f"{', '.join(SUPPORTED_ARCHS)})")
    for s in opts.splits:
        if not 1 <= s <= model_fp.n_layer - 1:
            raise FitError(f"split {s} is outside 1..{model_fp.n_layer - 1} (the model has {model_fp.n_layer} layers)")
        if s == model_fp.n_layer - 1:
            raise FitError(f"split {s} leaves no layer to map: layer {s} reads x_S itself, maps start at {s + 1}")
        if not opts.late_layers(s, model_fp.n_layer):
            raise FitError(f"--layers {opts.layer_range[0]}-{opts.layer_range[1]} holds no layer above split {s}")
    overlap = {d.doc_id for d in calib} & {d.doc_id for d in heldout}
    if overlap:
        names = sorted(d.name for d in heldout if d.doc_id in overlap)
        raise FitError(f"the held-out set overlaps the calibration set (same file content): {', '.join(names[:5])}")


def fit(model: Path, calib_paths: list, heldout_paths: list, out: Path, opts: FitOptions, *,
        sums_path: Path | None = None, force: bool = False, log: Callable[[str], None] = print) -> dict:
    t_start = time.perf_counter()
    model_fp = fmt.model_fingerprint(model)
    try:
        calib, heldout = list(iter_documents(calib_paths)), list(iter_documents(heldout_paths))
    except (OSError, ValueError) as e:
        raise FitError(str(e)) from e
    if not calib:
        raise FitError("the calibration text is empty")
    if not heldout:
        raise FitError("the held-out text is empty")
    validate(model_fp, calib, heldout, opts)
    outs = [output_path(out, s, len(opts.splits)) for s in opts.splits]
    for o in outs:
        if o.exists() and not force:
            raise FitError(f"{o} exists: pass --force to overwrite it")
    check_memory(model_fp.n_embd, model_fp.n_layer, opts.splits, opts=opts)
    model_sha = hashlib.sha256(f"{model_fp.path}:{model_fp.vocab_sha256}:{model_fp.n_layer}".encode()).hexdigest()
    sums_path = sums_path or out.with_name(out.stem + ".sums.npz")
    if sums_path.exists():
        state = CaptureState.load(sums_path)
        if state.model_sha != model_sha or {s: ss.layers for s, ss in state.splits.items()} != \
                {s: opts.late_layers(s, model_fp.n_layer) for s in opts.splits}:
            raise FitError(f"{sums_path} holds sums of another model, splits or layers: remove it or pass --sums")
        log(f"fit: resuming from {sums_path}: {len(state.done_docs)} documents, {state.tokens} tokens done")
    else:
        d, L = model_fp.n_embd, model_fp.n_layer
        # layer S itself reads x_S exactly: maps start at S+1
        state = CaptureState(model_sha, {s: SplitSums(s, opts.late_layers(s, L), d, d) for s in opts.splits},
                             options={"stride": opts.stride, "max_doc_tokens": opts.max_doc_tokens})
    wanted = sorted(set(opts.splits) | {layer for ss in state.splits.values() for layer in ss.layers})
    cap = Capturer(model, wanted, n_ctx=opts.max_doc_tokens, n_batch=opts.n_batch,
                   n_threads=opts.n_threads, n_gpu_layers=opts.n_gpu_layers)
    try:
        t0, tokens0 = time.perf_counter(), state.tokens
        capture_calibration(cap, calib, state, opts, sums_path, log)
        t_capture, tokens_captured = time.perf_counter() - t0, state.tokens - tokens0
        for s, ss in state.splits.items():
            if ss.n < ss.d_in:
                raise FitError(f"split {s}: {ss.n} calibration rows, fewer than d_in = {ss.d_in}: give more text")
        heldout_rows = capture_heldout(cap, heldout, opts, log)
        held_tokens = [cap.tokenize(d.text, opts.max_doc_tokens) for d in heldout] if opts.state_correction else []
    finally:
        cap.close()
    heldout_rows.save(heldout_path(sums_path))
    proj = CacheProjector(model)
    report = {"model": str(model), "architecture": model_fp.architecture, "n_layer": model_fp.n_layer,
              "n_embd": model_fp.n_embd, "calibration": {"documents": len(state.done_docs), "tokens": state.tokens,
                                                         "excluded_rows": state.excluded_rows,
                                                         "capture_seconds_this_run": t_capture,
                                                         "tokens_per_second": tokens_captured / t_capture
                                                         if tokens_captured else None},
              "heldout": {"documents": len(heldout), "rows": int(len(next(iter(heldout_rows.x.values()))))},
              "options": {k: v for k, v in asdict(opts).items() if k != "lambdas"},
              "lambdas": list(opts.lambdas), "splits": {}}
    for s, o in zip(opts.splits, outs):
        ss = state.splits[s]
        t0 = time.perf_counter()
        ev = evaluate(ss, heldout_rows, proj, opts.lambdas, log)
        t_solve = time.perf_counter() - t0
        write_split_maps(o, model_fp, ss, ev["best"], state, opts, force, ev["solution"])
        report["splits"][s] = split_report(ss, ev, o, t_solve)
        if opts.state_correction:
            deltas, n_states = measure_state_deltas(model, o, held_tokens, opts.state_every, log)
            write_state_deltas(o, deltas, o)
            report["splits"][s]["state_deltas"] = {"layers": sorted(deltas), "states_per_layer": n_states,
                                                  "every": opts.state_every, "documents": len(held_tokens)}
        log(f"fit: split {s}: lambda {ev['best']:.4g}, wrote {o}")
    report["seconds"] = time.perf_counter() - t_start
    write_reports(out, report)
    return report


def heldout_path(sums_path: Path) -> Path:
    return sums_path.with_name(sums_path.name.replace(".sums.npz", "") + ".heldout.npz")


def resolve(sums_path: Path, model: Path, out: Path, *, lam: float | None, lambdas, splits: list[int] | None,
            opts: FitOptions, force: bool, log) -> dict[int, tuple[Path, float]]:
    """`ridgefill-gguf solve`: maps from saved sums, at a given λ or one chosen on the saved held-out rows."""
    state = CaptureState.load(sums_path)
    model_fp = fmt.model_fingerprint(model)
    if any(ss.d_in != model_fp.n_embd for ss in state.splits.values()):
        raise FitError(f"{sums_path} was captured from a model {next(iter(state.splits.values())).d_in} wide; "
                       f"{model} is {model_fp.n_embd} wide")
    splits = splits or sorted(state.splits)
    missing = [s for s in splits if s not in state.splits]
    if missing:
        raise FitError(f"{sums_path} has no sums for split(s) {missing}; it has {sorted(state.splits)}")
    held = None
    if lam is None:
        hp = heldout_path(sums_path)
        if not hp.exists():
            raise FitError(f"no --lambda and no held-out rows at {hp} to choose one")
        held, proj = HeldOut.load(hp), CacheProjector(model)
    written = {}
    for s in splits:
        ss = state.splits[s]
        ev = {"best": lam, "solution": None} if lam is not None else \
            evaluate(ss, held, proj, lambdas or DEFAULT_LAMBDAS, log)
        o = output_path(out, s, len(splits))
        written[s] = (write_split_maps(o, model_fp, ss, ev["best"], state, opts, force, ev["solution"]), ev["best"])
    return written


def _scores(d: dict[int, LayerScore]) -> list[dict]:
    return [{"layer": s.layer, "input_cos": s.input_cos, "k_cos": s.k_cos, "v_cos": s.v_cos,
             "cache_cos": s.cache_cos} for s in d.values()]


def split_report(ss: SplitSums, ev: dict, out: Path, t_solve: float) -> dict:
    best = ev["grid"][ev["best"]]
    return {"rows": ss.n, "lambda": ev["best"], "maps": str(out), "solve_and_score_seconds": t_solve,
            "mean_cache_cos": {str(lam): float(np.mean([s.cache_cos for s in g.values()]))
                               for lam, g in ev["grid"].items()},
            "fitted": _scores(best), "identity": _scores(ev["identity"]),
            "fitted_beats_identity_layers": int(sum(best[layer].cache_cos > ev["identity"][layer].cache_cos
                                                    for layer in ss.layers)),
            "layers": len(ss.layers)}


def write_reports(out: Path, report: dict) -> None:
    name = lambda ext: out.with_name(f"{out.stem}.fit.{ext}")  # noqa: E731
    write_atomic(name("json"), json.dumps(report, indent=2, default=float) + "\n")
    lines = [f"# Fit report: {Path(report['model']).name}", "",
             f"{report['calibration']['documents']} calibration documents, {report['calibration']['tokens']} tokens "
             f"(capture: {report['calibration']['tokens_per_second'] or 0:.0f} tokens/s); "
             f"{report['heldout']['rows']} held-out rows", "",
             "Rows left out of the sums (attention sinks): "
             + "; ".join(f"split {s}: " + ", ".join(f"{k} {v}" for k, v in r.items())
                         for s, r in report['calibration']['excluded_rows'].items()), ""]
    for s, r in report["splits"].items():
        lines += [f"## Split {s}: lambda {r['lambda']:.4g}, {r['rows']} rows; fitted beats identity on "
                  f"{r['fitted_beats_identity_layers']}/{r['layers']} layers", "",
                  "| layer | input cos (fit) | input cos (identity) | K cos (fit) | V cos (fit) | K cos (identity) "
                  "| V cos (identity) |", "|---|---|---|---|---|---|---|"]
        f = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        for a, b in zip(r["fitted"], r["identity"]):
            lines.append(f"| {a['layer']} | {f(a['input_cos'])} | {f(b['input_cos'])} | {f(a['k_cos'])} | "
                         f"{f(a['v_cos'])} | {f(b['k_cos'])} | {f(b['v_cos'])} |")
        lines.append("")
    write_atomic(name("md"), "\n".join(lines))
    plot(report, name("png"))


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    splits = report["splits"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for s, r in splits.items():
        layers = [x["layer"] for x in r["fitted"]]
        axes[0].plot(layers, [x["cache_cos"] for x in r["fitted"]], marker="o", label=f"split {s}, fitted")
        axes[0].plot(layers, [x["cache_cos"] for x in r["identity"]], ls="--", label=f"split {s}, identity")
        lams = [float(k) for k in r["mean_cache_cos"]]
        axes[1].semilogx(lams, list(r["mean_cache_cos"].values()), marker="o", label=f"split {s}")
    axes[0].set(xlabel="layer", ylabel="held-out cache cosine", title="per layer, chosen lambda")
    axes[1].set(xlabel="lambda", ylabel="mean held-out cache cosine", title="lambda grid")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
