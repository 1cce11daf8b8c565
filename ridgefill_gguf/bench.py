"""`ridgefill-gguf bench`: time to first token, exact against RidgeFill, side by side on one server.

One llama-server per placement holds the maps; each prompt length is sent the stock way ("ridgefill": false)
and with RidgeFill, alternately, `repeats` times; each server start begins with a warm-up pair. Time to first
token is the server's prompt time (timings.prompt_ms); the speedup is the ratio of the medians. Beside it, two
ceilings (design brief §6): 1/r of paper §2.5 (every layer costs the same, the maps are free) and the share of
multiply-accumulates that remains (maps, filled rows' K/V projections, exact rows and attention counted).
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sysconfig
import threading
import time
from pathlib import Path
from typing import Callable

from .gguf_io import read_gguf
from .random_gguf import HYBRID_ARCHS, ModelShape
from .serve import Server, model_window
from .util import hardware, save_figure, write_atomic


# what the ceilings read of a model's shape, recorded with the results
SHAPE_FIELDS = ("arch", "n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "full_attention_interval",
                "ssm_d_conv", "ssm_d_state", "ssm_n_group", "ssm_dt_rank", "n_swa", "swa_pattern")


# where the maps live; "resident:identity" and "resident:none" time the fill without its map and without any
# fill (a profile of the fill phase: their differences are the map's and the K/V projections' cost)
PLACEMENTS = ("resident", "streamed")
FILL_VARIANTS = ("identity", "none")


def split_placement(placement: str) -> tuple[str, str]:
    """("resident", "ridge") for "resident"; ("resident", "none") for "resident:none"."""
    where, _, fill = placement.partition(":")
    if where not in PLACEMENTS or (fill and fill not in FILL_VARIANTS):
        raise ValueError(f"placement '{placement}': one of {', '.join(PLACEMENTS)}, optionally with "
                         f":{' or :'.join(FILL_VARIANTS)}")
    return where, fill or "ridge"


def layer_ceiling(n: int, split: int, tail: int, n_layer: int) -> float:
    """1/r with r = ((N-T)·S + T·L) / (N·L) (paper §2.5)."""
    t = min(tail, n)
    return n * n_layer / ((n - t) * split + t * n_layer)


def layer_macs(s: ModelShape) -> dict[str, float]:
    """Per row: a whole attention layer and its fill (the K/V projections), a whole Gated DeltaNet layer and its
    fill (the in-projections the states need, the conv and the state update, all of which a filled row still does;
    not the output gate z, which only rows with an output project); and per attended cell, QK and PV. A DeltaNet
    layer's state update counts its recurrence, four multiply-accumulates per state element per row (decay, read,
    delta write, output read). A mixture of experts counts the experts a row uses and the shared one."""
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    if s.n_expert:  # the used experts and the shared one, their router and the shared expert's gate
        ffn = 3 * s.n_embd * (s.n_expert_used * s.n_ff_exp + s.n_ff_shexp) + s.n_embd * (s.n_expert + 1)
    else:
        ffn = 3 * s.n_embd * s.n_ff
    gate = q if s.arch in HYBRID_ARCHS else 0  # the hybrids' query projection carries an output gate beside each head
    hk, nk, nv, hv = s.ssm_d_state, s.ssm_n_group, s.ssm_dt_rank, s.head_v_dim
    conv = 2 * nk * hk + nv * hv
    state = 4 * nv * hk * hv
    gdn_fill = s.n_embd * (conv + 2 * nv) + s.ssm_d_conv * conv + state
    return {"attention": s.n_embd * (q + gate + 2 * kv) + q * s.n_embd + ffn, "attention_fill": s.n_embd * 2 * kv,
            "deltanet": gdn_fill + 2 * nv * hv * s.n_embd + ffn, "deltanet_fill": gdn_fill,
            "deltanet_state": state, "cell": 2 * s.n_head * s.head_dim}


def row_cells(p0: int, p1: int, window: int = 0) -> float:
    """Cells the rows at positions [p0, p1) attend to, causally: p + 1 each, at most `window` (0: no window)."""
    def upto(p: int) -> float:  # rows [0, p)
        if not window or p <= window:
            return p * (p + 1) / 2
        return window * (window + 1) / 2 + (p - window) * window
    return upto(p1) - upto(p0)


def mac_counts(shape: ModelShape, n: int, split: int, n_filled: int, n_exact_rows: int, tail: int = 0,
               fill: str = "ridge", n_probe: int = 0, n_fill_skipped: int = 0) -> dict[str, float]:
    """Multiply-accumulates of exact prefill ("stock") and of RidgeFill's phases ("early", "fill", "exact",
    "probe").

    RidgeFill: layers [0, S) for every row; in each late layer, filled rows pay their map (after the split) and
    what the layer writes for them (an attention layer's K/V projections, a DeltaNet layer's in-projections, conv
    and state update; `fill` identity: no map; none: neither); exact rows (special, chosen, tail) pay the whole
    layer. Causal attention: a row at position p reads p + 1 cells. The last `tail` exact rows are the prompt's
    last rows, so they read nearly the whole context; the other exact rows are counted at the average length.
    The probe's n_probe rows run every late layer over the whole cache once more. A sliding-window layer's row
    attends to at most its window, and n_fill_skipped (row, layer) fills of the windowed late layers, which no
    reader reaches, cost nothing."""
    m = layer_macs(shape)
    recurrent = [shape.is_recurrent(il) for il in range(shape.n_layer)]
    windows = [shape.n_swa if shape.is_swa(il) else 0 for il in range(shape.n_layer)]
    t = min(tail, n_exact_rows, n)

    def every_row(w: int) -> float:
        return row_cells(0, n, w)

    def exact_rows(w: int) -> float:  # the tail at the prompt's end, the other exact rows at the average length
        return row_cells(n - t, n, w) + (n_exact_rows - t) * row_cells(0, n, w) / n

    def layers(il0: int, il1: int, rows: float, cells: Callable[[int], float]) -> float:
        return sum(rows * m["deltanet"] if recurrent[il] else rows * m["attention"] + m["cell"] * cells(windows[il])
                   for il in range(il0, il1))

    late = list(range(split, shape.n_layer))
    windowed = [il for il in late if windows[il]]
    skipped = n_fill_skipped / len(windowed) if windowed else 0.0  # per windowed late layer

    def fill_row(il: int) -> float:  # a filled row's map (after the split) and what the layer writes for it
        map_macs = shape.n_embd * shape.n_embd if fill == "ridge" and il > split else 0
        write = (m["deltanet_fill"] if recurrent[il] else m["attention_fill"]) if fill != "none" else 0
        return map_macs + write

    return {"stock": layers(0, shape.n_layer, n, every_row),
            "early": layers(0, split, n, every_row),
            "fill": sum((n_filled - (skipped if windows[il] else 0)) * fill_row(il) for il in late),
            "exact": layers(split, shape.n_layer, n_exact_rows, exact_rows),
            "probe": layers(split, shape.n_layer, n_probe, lambda w: n_probe * (min(n, w) if w else n))}


def mac_ceiling(shape: ModelShape, n: int, split: int, n_filled: int, n_exact_rows: int, tail: int = 0,
                fill: str = "ridge", n_probe: int = 0, n_fill_skipped: int = 0) -> float:
    """Exact prefill's multiply-accumulates over RidgeFill's (mac_counts)."""
    c = mac_counts(shape, n, split, n_filled, n_exact_rows, tail, fill, n_probe, n_fill_skipped)
    return c["stock"] / (c["early"] + c["fill"] + c["exact"] + c["probe"])


def state_update_rows(shape: ModelShape, n: int, split: int, n_probe: int = 0) -> dict[str, int]:
    """Rows through a Gated DeltaNet layer's state update, summed over its layers: stock runs every row through
    every one; RidgeFill too (sweep one below the split, the carry above it over filled and exact rows alike),
    and the probe's rows once more through the late ones."""
    recurrent = [shape.is_recurrent(il) for il in range(shape.n_layer)]
    late = sum(recurrent[split:])
    return {"stock": sum(recurrent) * n, "ridgefill": sum(recurrent) * n + late * n_probe}


def state_update_ceiling(shape: ModelShape, n: int, split: int, n_filled: int, n_exact_rows: int, exact_ms: float,
                         us_per_row: float, tail: int = 0, fill: str = "ridge", n_probe: int = 0) -> float:
    """The MAC ceiling with each Gated DeltaNet layer's state update at its measured time per row (us_per_row,
    tools/gpu/gdn_bench.cpp) instead of its arithmetic: upstream's kernel runs the rows in order, so it costs the
    same in both arms. The other multiply-accumulates run at the rate that leaves the exact arm its measured
    time."""
    c = mac_counts(shape, n, split, n_filled, n_exact_rows, tail, fill, n_probe)
    per_row = layer_macs(shape)["deltanet_state"]
    rows = state_update_rows(shape, n, split, n_probe)
    stock_state_ms = rows["stock"] * us_per_row / 1000
    if exact_ms <= stock_state_ms:
        raise ValueError(f"the state update alone ({stock_state_ms:.0f} ms) is not less than the exact arm "
                         f"({exact_ms:.0f} ms): us_per_row {us_per_row} does not belong to this run")
    rate = (c["stock"] - rows["stock"] * per_row) / (exact_ms - stock_state_ms)  # MACs per ms
    rf_macs = c["early"] + c["fill"] + c["exact"] + c["probe"] - rows["ridgefill"] * per_row
    return exact_ms / (rf_macs / rate + rows["ridgefill"] * us_per_row / 1000)


def add_state_update_ceilings(r: dict, us_per_row: float) -> dict:
    """A hybrid result's rows and selectors with state_update_ceiling and the share of it each reached."""
    shape = ModelShape(**{"arch": "unknown", **r["shape"]})
    r["state_update_us_per_row"] = us_per_row
    base = {(x["placement"], x["tokens"]): x for x in r["rows"]}
    for x in r["rows"]:
        rows = x["rows"]
        x["ceiling_state"] = state_update_ceiling(shape, x["tokens"], r["split"], rows["filled"],
                                                  rows["exact"] + rows["tail"], x["median_exact_ms"], us_per_row,
                                                  tail=rows["tail"], fill=split_placement(x["placement"])[1])
        x["share_of_state_ceiling"] = x["speedup"] / x["ceiling_state"]
    for x in r.get("selectors") or []:
        b = base[(x["placement"], x["tokens"])]
        n_exact = x["selected"] + b["rows"]["exact"] + b["rows"]["tail"]
        x["ceiling_state"] = state_update_ceiling(shape, x["tokens"], r["split"], x["prefix"] - x["selected"] -
                                                  b["rows"]["exact"], n_exact, b["median_exact_ms"], us_per_row,
                                                  tail=b["rows"]["tail"], n_probe=x["probe_rows"])
        x["share_of_state_ceiling"] = x["speedup_vs_exact"] / x["ceiling_state"]
    return r


def _number(text: str) -> float | None:
    """A field nvidia-smi printed, or None where it has none ("[N/A]", "[Not Supported]")."""
    try:
        return float(text)
    except ValueError:
        return None


def _mean(values) -> float | None:
    """The mean of the values nvidia-smi gave (None: it gave none)."""
    got = [v for v in values if v is not None]
    return statistics.fmean(got) if got else None


class DeviceMemory:
    """Each GPU's memory in use over time (one `nvidia-smi -lms` stream, MiB), to read the peak of a time window, and
    any other `fields` nvidia-smi reports (SM clock, power, temperature, utilization) to average over one. The GPUs
    are those CUDA_VISIBLE_DEVICES names, else every one. Inert where there is no nvidia-smi: peaks and means are
    then None."""

    def __init__(self, period_ms: int = 50, fields: tuple[str, ...] = ()):
        self.period_ms = period_ms
        self.fields = ("memory.used", *fields)
        # one entry per nvidia-smi cycle: when it began and each GPU's fields
        self.cycles: list[tuple[float, dict[int, tuple[float | None, ...]]]] = []
        self.proc = None

    def __enter__(self) -> "DeviceMemory":
        if shutil.which("nvidia-smi"):
            # nvidia-smi ignores CUDA_VISIBLE_DEVICES: a run on some GPUs of a machine watches those alone
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu=index,{','.join(self.fields)}",
                                          "--format=csv,noheader,nounits", f"-lms={self.period_ms}",
                                          *(["-i", visible] if visible else [])],
                                         stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        """Each cycle prints one line per GPU: a GPU seen again starts the next cycle."""
        for line in self.proc.stdout:
            index, *values = line.split(",")
            index = _number(index)
            if index is None:
                continue
            if not self.cycles or int(index) in self.cycles[-1][1]:
                self.cycles.append((time.monotonic(), {}))
            self.cycles[-1][1][int(index)] = tuple(_number(v) for v in values)

    def _window(self, t0: float, t1: float) -> list[dict[int, tuple[float | None, ...]]]:
        """The cycles begun in [t0, t1] and the one before t0, which still held then."""
        if not self.proc:
            return []
        time.sleep(2 * self.period_ms / 1000)  # let the window's cycles, and the next one's first line, arrive
        done = self.cycles[:-1]  # the last may still be printing
        before = [g for t, g in done if t < t0][-1:]
        return before + [g for t, g in done if t0 <= t <= t1]

    def peak(self, t0: float, t1: float) -> int | None:
        """The most memory in use at once on the GPUs together in [t0, t1] (MiB)."""
        return self.stats(t0, t1)[0]

    def stats(self, t0: float, t1: float) -> tuple[int | None, dict[int, dict[str, float | None]] | None]:
        """From one window: the peak of the GPUs together, and each GPU's peak memory (peak_mib) and the other
        fields' means over [t0, t1]."""
        window = self._window(t0, t1)
        if not window:
            return None, None
        total = int(max(sum(v[0] for v in g.values() if v[0] is not None) for g in window))
        devices = {}
        for i in sorted({i for g in window for i in g}):
            seen = [g[i] for g in window if i in g]
            used = [v[0] for v in seen if v[0] is not None]
            devices[i] = {"peak_mib": int(max(used)) if used else None,
                          **{f: _mean(v[k] for v in seen) for k, f in enumerate(self.fields) if k}}
        return total, devices

    def means(self, t0: float, t1: float) -> dict[str, float | None] | None:
        """Each field's mean over [t0, t1] on the first GPU."""
        window = self._window(t0, t1)
        if not window:
            return None
        first = min(i for g in window for i in g)
        seen = [g[first] for g in window if first in g]
        return {f: _mean(v[k] for v in seen) for k, f in enumerate(self.fields)}

    def __exit__(self, *exc) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait()


def timed(mem: DeviceMemory, request: Callable[[], dict]) -> tuple[dict, int | None]:
    """A request's response and the peak device memory while it ran."""
    response, peak, _ = timed_on_devices(mem, request)
    return response, peak


def timed_on_devices(mem: DeviceMemory, request: Callable[[], dict]) -> tuple[dict, int | None, dict | None]:
    """A request's response, the peak memory of all GPUs together while it ran, and each GPU's peak and means."""
    t0 = time.monotonic()
    response = request()
    return (response, *mem.stats(t0, time.monotonic()))


def merge_devices(runs: list[dict | None]) -> dict[str, dict] | None:
    """Several requests' per-GPU figures as one: the highest peak and the mean of each other field's means."""
    runs = [r for r in runs if r]
    if not runs:
        return None
    out = {}
    for i in sorted({i for r in runs for i in r}):
        seen = [r[i] for r in runs if i in r]
        peaks = [v["peak_mib"] for v in seen if v["peak_mib"] is not None]
        out[str(i)] = {"peak_mib": max(peaks) if peaks else None,
                       **{k: _mean(v.get(k) for v in seen) for k in seen[0] if k != "peak_mib"}}
    return out


def _max(values) -> int | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def default_text(min_chars: int) -> str:
    """Python standard library sources, on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(errors="replace")
        parts.append(text)
        total += len(text)
        if total >= min_chars:
            break
    return "\n\n".join(parts)


def run_bench(model: str | Path, maps: str | Path, lengths: list[int], *, tail: int = 1024,
              placements: tuple[str, ...] = ("resident",), repeats: int = 3, n_gpu_layers: int | None = None,
              threads: int | None = None, text: str | None = None, out_dir: str | Path = "results/bench",
              label: str | None = None, min_prefix: int | None = None, extra: tuple[str, ...] = (),
              vs_upstream: bool = False, selectors: tuple[str, ...] = (), exact_shares: tuple[float, ...] = (),
              state_update_us: float | None = None, swa_full: bool = True,
              log: Callable[[str], None] = print) -> dict:
    """selectors: per length, RidgeFill with each exact-row selector (per request) beside plain RidgeFill; "probe@1.5"
    is the probe with budget factor 1.5 (the server's budget otherwise).
    exact_shares: per length, RidgeFill with that share of the prefix as random exact rows, for the line
    tau(E) = tau0 + E sigma of paper Appendix H and kappa, an exact prefix row's cost over a tail row's.
    state_update_us: a hybrid's state update per row and layer as tools/gpu/gdn_bench.cpp measured it on this
    device, for the ceilings that time it (add_state_update_ceilings).
    swa_full: a windowed model's servers keep every row of the windowed cache (--swa-full) or one window of cells
    (False: llama-server's default, where RidgeFill reuses them as a ring); with vs_upstream the upstream server is
    also timed with the other cache."""
    shape = ModelShape.from_gguf(model)
    split = int(read_gguf(maps).get("ridgefill.split"))
    n_max = max(lengths)
    text = text or default_text(6 * n_max)
    rows, off_rows, commands, sel_rows, lines, builds, warmups = [], [], {}, [], [], {}, {}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hw = hardware()
    # a windowed model's servers all keep the same windowed cache, so that they prefill over the same cells
    windowed = model_window(model) > 0
    common = dict(n_ctx=n_max + 64, threads=threads, n_gpu_layers=n_gpu_layers, extra=extra,
                  swa_full=swa_full if windowed else None)

    def save(partial: bool) -> dict:
        """Written after every length, so a run cut short keeps what it measured."""
        result = {"benchmark": "time to first token, exact vs RidgeFill", "date": dt.date.today().isoformat(),
                  "hardware": hw, "model": str(model), "maps": str(maps), "split": split, "tail": tail,
                  "repeats": repeats, "n_gpu_layers": n_gpu_layers, "swa_full": common["swa_full"],
                  "shape": {k: getattr(shape, k) for k in SHAPE_FIELDS},
                  "server_commands": commands, "partial": partial, "rows": rows, "off_vs_upstream": off_rows,
                  "ridgefill_vs_upstream": against_upstream(rows, off_rows), "stock_warmup": warmups,
                  "selectors": sel_rows, "exact_rows_line": lines, "build": {**build_identity(), "servers": builds},
                  "environment": engine_environment()}
        if state_update_us and rows:
            add_state_update_ceilings(result, state_update_us)
        stem = f"{result['date']}-{label or Path(model).stem}"
        write_atomic(out_dir / f"{stem}.json", json.dumps(result, indent=2) + "\n")
        write_atomic(out_dir / f"{stem}.md", markdown(result))
        result["files"] = [str(out_dir / f"{stem}.{ext}") for ext in ("json", "md")]
        if not partial and rows:
            try:
                plot(result, out_dir / f"{stem}.png")
                result["files"].append(str(out_dir / f"{stem}.png"))
            except ImportError:  # no matplotlib (the GPU machine): plot(json.load(...), path) redraws it later
                pass
        return result

    def prompts(srv: Server) -> dict[int, list[int]]:
        all_tokens = srv.post("/tokenize", {"content": text, "add_special": True})["tokens"]
        if len(all_tokens) < n_max:
            raise ValueError(f"the text gives {len(all_tokens)} tokens, fewer than {n_max}")
        return {n: all_tokens[:n] for n in lengths}

    # utilization: the share of each sampling period a GPU ran a kernel, each GPU's share of a layer split's work
    with DeviceMemory(fields=("utilization.gpu",)) as mem:
        for placement in placements:
            where, fill = split_placement(placement)
            # research: the fill variants and the random rows of the exact-rows line are controls
            with Server(model, maps, tail=tail, placement=where, fill=fill, min_prefix=min_prefix, research=True,
                        log_path=out_dir / f"server-{placement.replace(':', '-')}.log", **common) as srv:
                commands[placement] = " ".join(srv.command)
                props = srv.get("/props")
                builds[placement] = props.get("build_info")
                # the factor a request without ridgefill_budget runs at
                default_budget = (props.get("ridgefill") or {}).get("budget")
                by_n = prompts(srv)
                # a warm-up pair per server start; its stock request comes before RidgeFill's buffers exist
                warm, stock_peak = timed(mem, lambda: srv.complete(by_n[lengths[0]], n_predict=1, ridgefill=False))
                # the only stock request this server runs before any RidgeFill request: beside the exact arm's
                # median it shows whether a RidgeFill request slows the stock requests after it
                warmups[placement] = {"tokens": lengths[0], "stock_ms": warm["timings"]["prompt_ms"]}
                # plain RidgeFill (no exact prefix rows) is the speed arm; selectors are timed beside it
                srv.complete(by_n[lengths[0]], n_predict=1, ridgefill=True, ridgefill_select="none")
                for n in lengths:
                    exact_ms, rf_ms, stats = [], [], []
                    peaks, gpus = {"exact": [], "ridgefill": []}, {"exact": [], "ridgefill": []}
                    for i in range(repeats):
                        r, m, g = timed_on_devices(mem, lambda: srv.complete(by_n[n], n_predict=1, ridgefill=False))
                        exact_ms.append(r["timings"]["prompt_ms"])
                        peaks["exact"].append(m)
                        gpus["exact"].append(g)
                        r, m, g = timed_on_devices(mem, lambda: srv.complete(by_n[n], n_predict=1, ridgefill=True,
                                                                             ridgefill_select="none"))
                        t = r["timings"]
                        if "ridgefill" not in t:
                            raise RuntimeError(f"{n} tokens: the server did not use RidgeFill (see {srv.log_path})")
                        rf_ms.append(t["prompt_ms"])
                        stats.append(t["ridgefill"])
                        peaks["ridgefill"].append(m)
                        gpus["ridgefill"].append(g)
                        log(f"bench: {placement} {n} tokens, run {i + 1}/{repeats}: exact {exact_ms[-1]:.0f} ms, "
                            f"RidgeFill {rf_ms[-1]:.0f} ms")
                    st = stats[-1]
                    med = phase_medians(stats, ("early_ms", "fill_ms", "exact_ms"))
                    speedup = statistics.median(exact_ms) / statistics.median(rf_ms)
                    c_layer = layer_ceiling(n, split, st["tail"], shape.n_layer)
                    c_mac = mac_ceiling(shape, n, split, st["filled"], st["exact"] + st["tail"], tail=st["tail"],
                                        fill=fill, n_fill_skipped=st.get("fill_skipped", 0))
                    rows.append({"placement": placement, "tokens": n, "exact_ms": exact_ms, "ridgefill_ms": rf_ms,
                                 "median_exact_ms": statistics.median(exact_ms),
                                 "median_ridgefill_ms": statistics.median(rf_ms), "speedup": speedup,
                                 "ceiling_layers": c_layer, "ceiling_macs": c_mac,
                                 "share_of_ceiling": speedup / c_mac,
                                 "rows": {k: st.get(k, 0) for k in ("filled", "exact", "special", "tail",
                                                                     "fill_skipped")},
                                 "phases_ms": med,
                                 "devices": device_stats(st),
                                 "gpus": {arm: merge_devices(runs) for arm, runs in gpus.items()},
                                 # MiB in use on the GPU: RidgeFill's buffers stay allocated once made, so the
                                 # exact arm's peak includes them; stock_before_ridgefill does not
                                 "peak_memory_mib": {"exact": _max(peaks["exact"]),
                                                     "ridgefill": _max(peaks["ridgefill"]),
                                                     "stock_before_ridgefill": stock_peak}})
                    log(f"bench: {placement} {n} tokens: speedup {speedup:.2f}x (ceiling {c_mac:.2f}x by MACs, "
                        f"{c_layer:.2f}x by layers)")
                    for sel in selectors:
                        sel_rows.append(time_selector(srv, by_n[n], sel, repeats, rows[-1], placement, n, log, shape,
                                                      split, default_budget))
                    if exact_shares:
                        lines.append(time_exact_rows(srv, by_n[n], exact_shares, repeats, rows[-1], placement, n, log))
                    save(partial=True)
        if vs_upstream:
            # the cost of carrying RidgeFill: upstream's server against the patched one with maps attached and
            # every request stock, both up at once, requests alternating
            with Server(model, build="upstream", log_path=out_dir / "server-upstream.log", **common) as up, \
                    Server(model, maps, tail=tail, log_path=out_dir / "server-off.log", **common) as off:
                commands["upstream"], commands["attached_off"] = " ".join(up.command), " ".join(off.command)
                builds["upstream"] = up.get("/props").get("build_info")
                by_n = prompts(up)
                up.complete(by_n[lengths[0]], n_predict=1)
                off.complete(by_n[lengths[0]], n_predict=1, ridgefill=False)
                for n in lengths:
                    up_ms, off_ms, up_gpus = [], [], []
                    for i in range(repeats):
                        r, _, g = timed_on_devices(mem, lambda: up.complete(by_n[n], n_predict=1))
                        up_ms.append(r["timings"]["prompt_ms"])
                        up_gpus.append(g)
                        t = off.complete(by_n[n], n_predict=1, ridgefill=False)["timings"]
                        if "ridgefill" in t:
                            raise RuntimeError(f"{n} tokens: RidgeFill ran on a request that switched it off")
                        off_ms.append(t["prompt_ms"])
                        log(f"bench: off vs upstream {n} tokens, run {i + 1}/{repeats}: upstream {up_ms[-1]:.0f} ms, "
                            f"attached but off {off_ms[-1]:.0f} ms")
                    off_rows.append({"tokens": n, "upstream_ms": up_ms, "off_ms": off_ms,
                                     "median_upstream_ms": statistics.median(up_ms),
                                     "median_off_ms": statistics.median(off_ms),
                                     "off_over_upstream": statistics.median(off_ms) / statistics.median(up_ms),
                                     "gpus": {"upstream": merge_devices(up_gpus)}})
                    save(partial=True)
            if windowed:
                time_upstream_other_cache(model, common, lengths, repeats, off_rows, commands, out_dir, prompts, log)
                save(partial=True)
    return save(partial=False)


def time_upstream_other_cache(model, common: dict, lengths: list[int], repeats: int, off_rows: list[dict],
                              commands: dict, out_dir: Path, prompts, log: Callable[[str], None]) -> None:
    """A windowed model's upstream server with the other windowed cache than the run's: one window of cells
    (llama-server's default) beside --swa-full, or every row beside one window. Started alone after the pair
    (two caches of every row may not fit beside a third)."""
    one_window = bool(common["swa_full"])  # the other cache
    key = "upstream_one_window" if one_window else "upstream_swa_full"
    with Server(model, build="upstream", log_path=out_dir / f"server-{key.replace('_', '-')}.log",
                **{**common, "swa_full": not one_window}) as up:
        commands[key] = " ".join(up.command)
        by_n = prompts(up)
        up.complete(by_n[lengths[0]], n_predict=1)
        for row in off_rows:
            ms = [up.complete(by_n[row["tokens"]], n_predict=1)["timings"]["prompt_ms"] for _ in range(repeats)]
            row[f"{key}_ms"] = ms
            row[f"median_{key}_ms"] = statistics.median(ms)
            log(f"bench: {key.replace('_', ' ')}, {row['tokens']} tokens: {statistics.median(ms):.0f} ms")


def against_upstream(rows: list[dict], off_rows: list[dict]) -> list[dict]:
    """RidgeFill's median against the upstream build's stock prefill of the same length (timed in the same run),
    and the exact arm's (stock requests on the RidgeFill server, between RidgeFill requests) against it too."""
    upstream = {x["tokens"]: x["median_upstream_ms"] for x in off_rows}
    out = []
    for x in rows:
        up = upstream.get(x["tokens"])
        if up:
            speedup = up / x["median_ridgefill_ms"]
            out.append({"placement": x["placement"], "tokens": x["tokens"], "median_upstream_ms": up,
                        "median_ridgefill_ms": x["median_ridgefill_ms"], "speedup": speedup,
                        "share_of_ceiling": speedup / x["ceiling_macs"],
                        "exact_over_upstream": x["median_exact_ms"] / up})
    return out


def refresh_ceilings(r: dict) -> dict:
    """A result's MAC ceilings, and the shares that divide by them, recomputed with mac_ceiling as it is now
    (results written before 2026-12-01's correction counted the tail's attention at the average length)."""
    shape = ModelShape(**{"arch": "unknown", **r["shape"]})  # the earliest results did not record the arch
    for x in r["rows"]:
        rows = x["rows"]
        x["ceiling_macs"] = mac_ceiling(shape, x["tokens"], r["split"], rows["filled"], rows["exact"] + rows["tail"],
                                        tail=rows["tail"], fill=split_placement(x["placement"])[1],
                                        n_fill_skipped=rows.get("fill_skipped", 0))
        x["share_of_ceiling"] = x["speedup"] / x["ceiling_macs"]
    r["ridgefill_vs_upstream"] = against_upstream(r["rows"], r.get("off_vs_upstream") or [])
    return r


def build_identity() -> dict:
    """Which code ran: this checkout's commit and the patch series applied to llama.cpp."""
    root = Path(__file__).resolve().parent.parent
    series = sorted((root / "patches").glob("*.patch"))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=30).stdout.strip() or None
    except OSError:
        commit = None
    return {"commit": commit, "patches": len(series),
            "patch_series_sha256": hashlib.sha256(b"".join(p.read_bytes() for p in series)).hexdigest()[:16]}


def device_stats(st: dict) -> dict:
    """A layer split's figures from timings.ridgefill: the devices holding late layers, the bytes RidgeFill's graphs
    moved between devices, and which device ran each phase's layers."""
    return {k: st.get(k) for k in ("late_devices", "bytes_moved", "devices")}


def ridgefill_requests(srv: Server, prompt: list[int], repeats: int, **request) -> tuple[list[float], list[dict]]:
    """prompt_ms and timings.ridgefill of `repeats` RidgeFill requests; a request RidgeFill did not serve raises."""
    ms, stats = [], []
    for _ in range(repeats):
        t = srv.complete(prompt, n_predict=1, ridgefill=True, **request)["timings"]
        if "ridgefill" not in t or "refused" in t["ridgefill"]:
            raise RuntimeError(f"{len(prompt)} tokens, {request}: RidgeFill did not run: {t.get('ridgefill')}")
        ms.append(t["prompt_ms"])
        stats.append(t["ridgefill"])
    return ms, stats


def selector_request(selector: str) -> dict:
    """A selector's request fields: "probe", or "probe@1.5" for the probe (or random rows) with that budget factor."""
    name, _, budget = selector.partition("@")
    return {"ridgefill_select": name, **({"ridgefill_budget": float(budget)} if budget else {})}


def time_selector(srv: Server, prompt: list[int], selector: str, repeats: int, base: dict, placement: str,
                  n: int, log: Callable[[str], None], shape: ModelShape, split: int,
                  default_budget: float | None) -> dict:
    """RidgeFill with one exact-row selector, against the same length's exact and plain RidgeFill medians."""
    request = selector_request(selector)
    ridgefill_requests(srv, prompt, 1, **request)  # warm-up: its buffers
    ms, stats = ridgefill_requests(srv, prompt, repeats, **request)
    st, med = stats[-1], statistics.median(ms)
    log(f"bench: {placement} {n} tokens, {selector}: {med:.0f} ms, {st['selected']} rows selected")
    c_mac = mac_ceiling(shape, n, split, st["filled"], st["exact"] + st["tail"], tail=st["tail"],
                        n_probe=st.get("probe_rows", 0), n_fill_skipped=st.get("fill_skipped", 0))
    factor = request.get("ridgefill_budget", default_budget)  # the factor it ran at
    return {"placement": placement, "tokens": n, "selector": selector, "budget_factor": factor,
            "ms": ms, "median_ms": med,
            "speedup_vs_exact": base["median_exact_ms"] / med, "vs_plain": base["median_ridgefill_ms"] / med,
            "ceiling_macs": c_mac, "share_of_ceiling": base["median_exact_ms"] / med / c_mac,
            "probe_rows": st.get("probe_rows", 0),
            "selected": st["selected"], "budget": st.get("budget", 0), "lexical": st.get("lexical", 0),
            "prefix": st["filled"] + st["exact"],
            "devices": device_stats(st),
            "phases_ms": phase_medians(stats, ("early_ms", "fill_ms", "exact_ms", "probe_ms"))}


def phase_medians(stats: list[dict], phases: tuple[str, ...]) -> dict[str, float]:
    """Median per phase, the engine's total and the server's wall time, the recurrent layers' part of the late pass
    (hybrids), and what the phases leave out of the total (planning between the sweeps, the head's logits): time no
    phase accounts for shows here, not hidden."""
    med = {k: statistics.median(s[k] for s in stats) for k in phases}
    for k in ("total_ms", "wall_ms", "recurrent_ms"):
        if all(k in s for s in stats):
            med[k] = statistics.median(s[k] for s in stats)
    if "total_ms" in med:
        med["other_ms"] = statistics.median(s["total_ms"] - sum(s[k] for k in phases) for s in stats)
    return med


def phase_cell(p: dict) -> str:
    exact = f"{p['exact_ms']:.0f}" + (f" ({p['recurrent_ms']:.0f})" if p.get("recurrent_ms") else "")
    return f"{p['early_ms']:.0f} / {p['fill_ms']:.0f} / {exact} / {p.get('other_ms', float('nan')):.0f}"


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares: (tau0, sigma) of tau = tau0 + E sigma."""
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    sigma = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx if sxx else 0.0
    return my - sigma * mx, sigma


def time_exact_rows(srv: Server, prompt: list[int], shares: tuple[float, ...], repeats: int, base: dict,
                    placement: str, n: int, log: Callable[[str], None]) -> dict:
    """tau(E) with E random exact prefix rows (E = share x the prefix), its line, and kappa: sigma over a tail
    row's time in the late layers (the exact phase with no exact prefix rows, per tail row)."""
    points, exact_phase0, tail = [], None, None
    for share in (0.0, *[x for x in shares if x > 0]):
        ms, stats = ridgefill_requests(srv, prompt, repeats, ridgefill_select="random", ridgefill_exact_share=share)
        e = stats[-1]["exact"] - stats[-1]["special"]
        points.append((e, statistics.median(ms)))
        if share == 0.0:
            exact_phase0 = statistics.median(s["exact_ms"] for s in stats)
            tail = stats[-1]["tail"]
        log(f"bench: {placement} {n} tokens, {e} random exact rows: {points[-1][1]:.0f} ms")
    tau0, sigma = fit_line(points)
    tail_row_ms = exact_phase0 / tail if exact_phase0 and tail else None
    return {"placement": placement, "tokens": n, "points": [{"exact_rows": e, "median_ms": m} for e, m in points],
            "tau0_ms": tau0, "sigma_ms_per_row": sigma, "tail_row_ms": tail_row_ms,
            "kappa": sigma / tail_row_ms if tail_row_ms else None,
            # how many exact prefix rows keep RidgeFill no slower than exact prefill (Appendix H)
            "break_even_rows": (base["median_exact_ms"] - tau0) / sigma if sigma > 0 else None}


def engine_environment() -> dict[str, str]:
    """The environment variables that change what the servers run (LLAMA_RIDGEFILL_HOST_MASK, LLAMA_ARG_*)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("LLAMA_RIDGEFILL_", "LLAMA_ARG_"))}


def markdown_table(caption: str | None, header: list[str], rows: list[list]) -> list[str]:
    """Markdown lines of one table, after a blank line and its caption when it has one."""
    lines = ["", caption, ""] if caption else []
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def split_table(r: dict) -> list[str]:
    """Where the servers ran on several GPUs: each GPU's peak memory and busy share per arm, and what RidgeFill's
    graphs moved between them (nothing when the run watched one GPU)."""
    arms = [(x["placement"], x["tokens"], arm, g, x) for x in r["rows"]
            for arm, g in (x.get("gpus") or {}).items() if g]
    # upstream's server was timed beside the patched one (attached, off), whose memory the peaks include
    arms += [("upstream", x["tokens"], "upstream (the off server loaded too)", x["gpus"]["upstream"], None)
             for x in r.get("off_vs_upstream", []) if (x.get("gpus") or {}).get("upstream")]
    if not arms or max(len(g) for *_, g, _ in arms) < 2:
        return []

    def moved(x: dict | None, arm: str) -> str:
        d = (x or {}).get("devices") or {}
        if arm != "ridgefill" or d.get("bytes_moved") is None:
            return ""
        return f"{d['bytes_moved'] / 2**20:.1f} MiB over {d['late_devices']} late devices ({d['devices']})"

    def gpu(i: str, v: dict) -> str:
        busy = v.get("utilization.gpu")
        return f"GPU {i}: {v['peak_mib'] if v['peak_mib'] is not None else 'n/a'} / " + \
            (f"{busy:.0f}%" if busy is not None else "n/a")

    return markdown_table("Each GPU: peak memory (MiB) / busy (nvidia-smi's utilization.gpu, the share of the "
                          "driver's own sample period, 1/6 s to 1 s, in which a kernel ran, averaged over the "
                          "request: coarse, lagged and low for short requests, but per GPU), and the bytes "
                          "RidgeFill's graphs moved between devices:",
                          ["placement", "tokens", "arm", "per GPU: peak MiB / busy", "moved by RidgeFill"],
                          [[p, n, arm, ", ".join(gpu(i, v) for i, v in g.items()), moved(x, arm)]
                           for p, n, arm, g, x in arms])


def markdown(r: dict) -> str:
    hw = r["hardware"]
    env = r.get("environment") or {}
    lines = [f"# Time to first token: {Path(r['model']).name}, split {r['split']}, tail {r['tail']}", "",
             f"{r['date']}; {hw.get('gpu') or hw['cpu']}; {hw['cores']} cores; medians of {r['repeats']} "
             "requests per arm, alternating on one server started once per placement, after one warm-up pair"
             + (f"; environment {', '.join(f'{k}={v}' for k, v in env.items())}" if env else ""), "",
             "Ceilings: 1/r counts layers (paper §2.5); the MAC ceiling counts multiply-accumulates: the maps, what "
             "filled rows still do (an attention layer's K/V projections; a Gated DeltaNet layer's in-projections, "
             "conv and state update), the probe's rows, and for exact rows the whole layer with causal attention "
             "(the tail reads its own prefix, nearly the whole context).", ""]
    lines += markdown_table(None, ["placement", "tokens", "exact (ms)", "RidgeFill (ms)", "speedup", "ceiling (MACs)",
                           "ceiling (1/r)", "share of MAC ceiling", "filled / exact / tail rows",
                           "sweep one / fill / exact (recurrent layers) / other (ms)"],
                    [[x["placement"], x["tokens"], f"{x['median_exact_ms']:.0f}", f"{x['median_ridgefill_ms']:.0f}",
                      f"{x['speedup']:.2f}x", f"{x['ceiling_macs']:.2f}x", f"{x['ceiling_layers']:.2f}x",
                      f"{100 * x['share_of_ceiling']:.0f}%",
                      f"{x['rows']['filled']} / {x['rows']['exact']} / {x['rows']['tail']}",
                      phase_cell(x["phases_ms"])] for x in r["rows"]])
    mem = [x for x in r["rows"] if x.get("peak_memory_mib", {}).get("ridgefill")]
    if mem:
        lines += markdown_table("Peak GPU memory in use (MiB, every GPU together; RidgeFill's buffers stay allocated once made, so the exact arm "
                        "after the first RidgeFill request includes them):",
                        ["placement", "tokens", "stock before RidgeFill", "exact", "RidgeFill"],
                        [[x["placement"], x["tokens"], x["peak_memory_mib"]["stock_before_ridgefill"],
                          x["peak_memory_mib"]["exact"], x["peak_memory_mib"]["ridgefill"]] for x in mem])
    lines += split_table(r)
    if r.get("selectors"):
        lines += markdown_table("Exact-row selectors (medians, ms; per request, on the same server):",
                        ["placement", "tokens", "selector", "RidgeFill + selector", "vs exact", "vs plain RidgeFill",
                         "rows selected (of the prefix)", "budget E / lexical", "probe (ms)", "ceiling (MACs)",
                         "share of MAC ceiling"],
                        [[x["placement"], x["tokens"], x["selector"], f"{x['median_ms']:.0f}",
                          f"{x['speedup_vs_exact']:.2f}x", f"{x['vs_plain']:.2f}x",
                          f"{x['selected']} ({100 * x['selected'] / max(x['prefix'], 1):.0f}%)",
                          f"{x['budget']} / {x['lexical']}", f"{x['phases_ms']['probe_ms']:.0f}",
                          f"{x['ceiling_macs']:.2f}x" if "ceiling_macs" in x else "",
                          f"{100 * x['share_of_ceiling']:.0f}%" if "share_of_ceiling" in x else ""]
                         for x in r["selectors"]])
    if r.get("state_update_us_per_row"):
        arms = [(x["placement"], x["tokens"], "plain", x["speedup"], x) for x in r["rows"]] + \
               [(x["placement"], x["tokens"], x["selector"], x["speedup_vs_exact"], x) for x in r.get("selectors") or []]
        lines += markdown_table(f"With each Gated DeltaNet layer's state update at its measured "
                        f"{r['state_update_us_per_row']:.3f} us per row (upstream's kernel, tools/gpu/gdn_bench.cpp) "
                        "in both arms, the other multiply-accumulates at the rate the exact arm leaves them:",
                        ["placement", "tokens", "arm", "speedup", "ceiling (MACs, state update timed)", "share"],
                        [[p, n, arm, f"{sp:.2f}x", f"{x['ceiling_state']:.2f}x",
                          f"{100 * x['share_of_state_ceiling']:.0f}%"] for p, n, arm, sp, x in arms])
    if r.get("exact_rows_line"):
        lines += markdown_table("Exact prefix rows and time (paper Appendix H: tau(E) = tau0 + E sigma; kappa = sigma over a "
                        "tail row's late-layer time; random rows, medians):",
                        ["placement", "tokens", "E: median ms", "tau0 (ms)", "sigma (ms/row)", "kappa",
                         "rows affordable"],
                        [[x["placement"], x["tokens"],
                          ", ".join(f"{p['exact_rows']}: {p['median_ms']:.0f}" for p in x["points"]),
                          f"{x['tau0_ms']:.0f}", f"{x['sigma_ms_per_row']:.4f}",
                          f"{x['kappa']:.2f}" if x["kappa"] is not None else "n/a",
                          f"{x['break_even_rows']:.0f}" if x["break_even_rows"] is not None else "n/a"]
                         for x in r["exact_rows_line"]])
    if r.get("off_vs_upstream"):
        lines += markdown_table("RidgeFill attached but off, against the upstream build (medians, ms):",
                        ["tokens", "upstream", "attached, off", "off / upstream"],
                        [[x["tokens"], f"{x['median_upstream_ms']:.0f}", f"{x['median_off_ms']:.0f}",
                          f"{x['off_over_upstream']:.3f}"] for x in r["off_vs_upstream"]])
        caches = [(x["tokens"], x.get("median_upstream_swa_full_ms", x["median_upstream_ms"]),
                   x.get("median_upstream_one_window_ms", x["median_upstream_ms"])) for x in r["off_vs_upstream"]
                  if "median_upstream_one_window_ms" in x or "median_upstream_swa_full_ms" in x]
        if caches:
            lines += markdown_table("Upstream's windowed cache: every row (--swa-full) against one window of cells "
                                    "(llama-server's default); the servers above kept "
                                    f"{'every row' if r.get('swa_full', True) else 'one window'} (medians, ms):",
                                    ["tokens", "upstream, --swa-full", "upstream, one window", "one window / full"],
                                    [[n, f"{full:.0f}", f"{one:.0f}", f"{one / full:.3f}"] for n, full, one in caches])
    if r.get("ridgefill_vs_upstream"):
        lines += markdown_table("RidgeFill against the upstream build's stock prefill (medians, ms; the exact arm above runs "
                        "on the RidgeFill server between RidgeFill requests):",
                        ["placement", "tokens", "upstream", "RidgeFill", "speedup", "share of MAC ceiling",
                         "exact arm / upstream"],
                        [[x["placement"], x["tokens"], f"{x['median_upstream_ms']:.0f}",
                          f"{x['median_ridgefill_ms']:.0f}", f"{x['speedup']:.2f}x",
                          f"{100 * x['share_of_ceiling']:.0f}%", f"{x['exact_over_upstream']:.3f}"]
                         for x in r["ridgefill_vs_upstream"]])
    if r.get("stock_warmup"):
        lines += ["", "The stock warm-up request of each server, the only one before any RidgeFill request (ms): "
                  + ", ".join(f"{p} {w['stock_ms']:.0f} at {w['tokens']} tokens" for p, w in r["stock_warmup"].items())
                  + "."]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for placement in sorted({x["placement"] for x in r["rows"]}):
        xs = [x for x in r["rows"] if x["placement"] == placement]
        ax.plot([x["tokens"] for x in xs], [x["speedup"] for x in xs], "o-", label=f"measured, {placement}")
    xs = [x for x in r["rows"] if x["placement"] == r["rows"][0]["placement"]]
    ax.plot([x["tokens"] for x in xs], [x["ceiling_macs"] for x in xs], "k--", label="ceiling (MACs)")
    ax.plot([x["tokens"] for x in xs], [x["ceiling_layers"] for x in xs], "k:", label="ceiling (1/r)")
    up = [x for x in r.get("ridgefill_vs_upstream") or [] if x["placement"] == r["rows"][0]["placement"]]
    if up:
        ax.plot([x["tokens"] for x in up], [x["speedup"] for x in up], "s-.",
                label=f"against upstream, {up[0]['placement']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("speedup of time to first token")
    ax.set_title(f"{Path(r['model']).name}, split {r['split']}, tail {r['tail']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
