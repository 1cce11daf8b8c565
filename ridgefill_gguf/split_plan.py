"""A model of RidgeFill's prefill on a layer split (llama.cpp's `-sm layer`) over several GPUs or RPC hosts: what
crosses between devices, when, and how busy each device is, against the stock prefill on the same split.

Each device holds a contiguous range of layers and computes at one rate (multiply-accumulates per second, from
`bench.layer_macs`); a link moves bytes at one bandwidth after a fixed latency. The stock prefill runs ubatches
through the devices as llama.cpp's pipeline parallelism does (ubatch k on device g after ubatch k on g - 1 and
ubatch k - 1 on g, at most four in flight: GGML_SCHED_MAX_COPIES). RidgeFill runs sweep one the same way over the layers below the split, sends x_S to each device
that holds late layers, fills every late attention layer on its own device (all devices at once), then passes the
late units through the late devices in position order, pipelined like the ubatches: a dense model's chunks of exact
rows (tail, chosen rows), a hybrid's groups of rows (its recurrent layers carry every row), with the probe's pass
(its rows through every late layer) before them. Every hidden state crosses a boundary as F32.

  python -m ridgefill_gguf.split_plan -o results/plan/NAME     # writes NAME.json and NAME.md
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from .bench import layer_macs, markdown_table, row_cells
from .random_gguf import REAL_SHAPES, ModelShape
from .util import write_atomic

GB = 1e9
IN_FLIGHT = 4  # ggml's scheduler keeps up to GGML_SCHED_MAX_COPIES graphs in flight with pipeline parallelism


@dataclasses.dataclass(frozen=True)
class Link:
    name: str
    bytes_per_s: float
    latency_s: float
    hops: int = 1  # an RPC boundary crosses the client: server to client, client to server


LINKS = {"nvlink": Link("NVLink (H100/H200, ~300 GB/s a direction)", 300 * GB, 5e-6),
         "pcie5": Link("PCIe 5 x16 peer copy (~40 GB/s)", 40 * GB, 10e-6),
         "rpc-100g": Link("RPC hosts, 100 Gbit/s", 12.5 * GB, 50e-6, hops=2),
         "rpc-10g": Link("RPC hosts, 10 Gbit/s", 1.25 * GB, 100e-6, hops=2)}


@dataclasses.dataclass(frozen=True)
class Workload:
    n: int = 32768            # prompt rows
    split: int = 16
    tail: int = 4096
    exact_share: float = 0.0  # share of the prefix kept exact (the default selector: about a quarter)
    probe_rows: int = 256
    ubatch: int = 512
    chunk: int = 4096         # exact rows per late chunk; a hybrid's carry group


def even_split(n_layer: int, n_dev: int) -> list[int]:
    """Device boundaries [0, b1, ..., n_layer] with layers shared evenly, as llama.cpp's default split of a model
    whose layers weigh the same."""
    return [round(g * n_layer / n_dev) for g in range(n_dev + 1)]


def exact_rows(w: Workload) -> int:
    """The tail and the share of the prefix kept exact."""
    return w.tail + round(w.exact_share * (w.n - w.tail))


def layer_costs(s: ModelShape, w: Workload) -> dict[str, list[float]]:
    """Per layer, multiply-accumulates: the stock prefill's (every row), sweep one's (below the split), the fill's
    (filled rows after the split) and the late units' (exact rows; a hybrid's recurrent layers also carry the filled
    rows)."""
    m = layer_macs(s)
    n_exact = exact_rows(w)
    n_filled = w.n - n_exact
    out = {"stock": [], "fill": [], "late": []}
    for il in range(s.n_layer):
        win = s.n_swa if s.is_swa(il) else 0
        recurrent = s.is_recurrent(il)
        whole = m["deltanet"] if recurrent else m["attention"]
        cells = 0 if recurrent else m["cell"]
        out["stock"].append(w.n * whole + cells * row_cells(0, w.n, win))
        late = il >= w.split
        fill_row = (s.n_embd * s.n_embd if il > w.split else 0) + (0 if recurrent else m["attention_fill"])
        out["fill"].append(n_filled * fill_row if late and not recurrent else 0.0)
        exact = n_exact * whole + cells * (row_cells(w.n - w.tail, w.n, win)
                                           + (n_exact - w.tail) * row_cells(0, w.n, win) / w.n)
        carried = n_filled * (m["deltanet_fill"] + (s.n_embd * s.n_embd if il > w.split else 0)) if recurrent else 0.0
        out["late"].append(exact + carried if late else 0.0)
    return out


def ridgefill_costs(s: ModelShape, w: Workload) -> list[float]:
    """Per layer, RidgeFill's multiply-accumulates: sweep one below the split, the fill and the late units above."""
    c = layer_costs(s, w)
    return [(a if il < w.split else 0.0) + b + d for il, (a, b, d) in enumerate(zip(c["stock"], c["fill"], c["late"]))]


def balanced_split(costs: list[float], n_dev: int) -> list[int]:
    """Contiguous boundaries that share `costs` (per layer) as evenly as a greedy cut can."""
    total, bounds, acc = sum(costs), [0], 0.0
    for il, c in enumerate(costs):
        acc += c
        if len(bounds) < n_dev and acc >= total * len(bounds) / n_dev and il + 1 < len(costs):
            bounds.append(il + 1)
    while len(bounds) < n_dev:
        bounds.append(len(costs))
    return bounds + [len(costs)]


def pipeline(units: list[list[float]], xfer: float, ready: list[float] | None = None,
             in_flight: int = IN_FLIGHT) -> tuple[list[float], list[float]]:
    """units[k][g]: seconds unit k spends on device g (0: the device holds none of its layers). A unit goes device by
    device; a device takes units in order; crossing to the next device that works on it costs `xfer`; unit k starts
    once unit k - in_flight has ended. ready[g]: when device g may start. Returns (each unit's end, each device's
    finishing time)."""
    n_dev = len(units[0]) if units else 0
    free = list(ready or [0.0] * n_dev)
    ends = []
    for k, times in enumerate(units):
        t, last = ends[k - in_flight] if k >= in_flight else 0.0, None
        for g, c in enumerate(times):
            if c <= 0:
                continue
            t = max(t + (xfer if last is not None else 0.0), free[g]) + c
            free[g], last = t, g
        ends.append(t)
    return ends, free


def simulate(s: ModelShape, w: Workload, bounds: list[int], link: Link, rate: float, overlap: bool = False) -> dict:
    """Time to first token of stock and RidgeFill on the split `bounds`, the bytes crossing and the devices' busy
    share (compute over devices x time). overlap: x_S goes to the late devices a ubatch at a time as sweep one makes
    it, each late device fills those rows at once, and the late units are a ubatch of rows each (a plan, not what
    the engine does today)."""
    n_dev = len(bounds) - 1
    dev_of = [next(g for g in range(n_dev) if bounds[g] <= il < bounds[g + 1]) for il in range(s.n_layer)]
    costs = layer_costs(s, w)
    row_bytes = 4 * s.n_embd
    hop = lambda rows: link.hops * (link.latency_s + rows * row_bytes / link.bytes_per_s)  # noqa: E731

    def per_device(values: list[float], layers: range) -> list[float]:
        out = [0.0] * n_dev
        for il in layers:
            out[dev_of[il]] += values[il] / rate
        return out

    n_ub = math.ceil(w.n / w.ubatch)
    stock_dev = per_device(costs["stock"], range(s.n_layer))
    stock_t = max(pipeline([[c / n_ub for c in stock_dev]] * n_ub, hop(w.ubatch))[0])
    early_dev = per_device(costs["stock"], range(w.split))
    sweep_ends, sweep_free = pipeline([[c / n_ub for c in early_dev]] * n_ub, hop(w.ubatch))
    sweep_t = max(sweep_ends)
    # x_S leaves the split's device to every other device that holds late layers, one after another
    late_devs = sorted({dev_of[il] for il in range(w.split, s.n_layer)})
    src = dev_of[w.split - 1]
    others = [g for g in late_devs if g != src]
    fill_dev = per_device(costs["fill"], range(w.split, s.n_layer))
    ready = list(sweep_free)
    if overlap:  # ubatch k's x_S reaches the late devices as sweep one makes it, and they fill its rows
        link_free = 0.0
        for end in sweep_ends:
            for g in late_devs:
                arrive = end
                if g != src:
                    link_free = max(link_free, end) + hop(w.ubatch)
                    arrive = link_free
                ready[g] = max(ready[g], arrive) + fill_dev[g] / n_ub
    else:
        t = sweep_t
        for g in late_devs:
            t += hop(w.n) if g != src else 0.0
            ready[g] = max(ready[g], t if g != src else sweep_t) + fill_dev[g]
    late_dev = per_device(costs["late"], range(w.split, s.n_layer))
    hybrid = any(s.is_recurrent(il) for il in range(w.split, s.n_layer))
    n_exact = exact_rows(w)
    chunk = w.ubatch if overlap else w.chunk
    n_units = math.ceil((w.n if hybrid else n_exact) / chunk)
    unit_rows = math.ceil(n_exact / n_units)
    probe = [0.0] * n_dev
    if w.exact_share > 0:
        per_row = layer_macs(s)
        for il in range(w.split, s.n_layer):
            probe[dev_of[il]] += w.probe_rows * (per_row["deltanet"] if s.is_recurrent(il) else
                                                 per_row["attention"] + per_row["cell"] * w.n) / rate
    units = ([probe] if w.exact_share > 0 else []) + [[c / n_units for c in late_dev]] * n_units
    rf_t = max(pipeline(units, hop(unit_rows), ready)[0])

    def boundaries(lo: int, hi: int) -> int:
        return sum(1 for g in range(1, n_dev) if lo < bounds[g] < hi)

    moved = {"stock": w.n * row_bytes * boundaries(0, s.n_layer) * link.hops,
             "sweep_one": w.n * row_bytes * boundaries(0, w.split) * link.hops,
             "x_split": w.n * row_bytes * len(others) * link.hops,
             "late_units": n_exact * row_bytes * boundaries(w.split, s.n_layer) * link.hops}
    rf_work = [a + b + c + d for a, b, c, d in zip(early_dev, fill_dev, late_dev, probe)]
    return {"devices": n_dev, "bounds": bounds, "link": link.name, "overlap": overlap, "stock_s": stock_t,
            "ridgefill_s": rf_t, "speedup": stock_t / rf_t,
            "busy_stock": sum(stock_dev) / (n_dev * stock_t), "busy_ridgefill": sum(rf_work) / (n_dev * rf_t),
            "phases_s": {"sweep_one": sweep_t, "fills_done": max(ready), "late": rf_t - max(ready)},
            "bytes": moved, "idle_in_sweep_one": [g for g in range(n_dev) if early_dev[g] == 0]}


def plan(preset: str, w: Workload, rate: float, devices=(1, 2, 4, 8), links=tuple(LINKS)) -> list[dict]:
    """Stock on llama.cpp's even split against RidgeFill on the even split, on a split that shares RidgeFill's work,
    and on that split with x_S and the fills overlapping sweep one."""
    s = REAL_SHAPES[preset]
    rf_costs = ridgefill_costs(s, w)
    rows = []
    for n_dev in devices:
        balanced = balanced_split(rf_costs, n_dev)
        arms = [("even", even_split(s.n_layer, n_dev), False), ("balanced", balanced, False),
                ("balanced+overlap", balanced, True)]
        for name in links if n_dev > 1 else links[:1]:
            stock_even = None  # the even arm comes first
            for arm, bounds, overlap in arms if n_dev > 1 else arms[:1]:
                r = simulate(s, w, bounds, LINKS[name], rate, overlap)
                stock_even = stock_even or r["stock_s"]
                rows.append({"preset": preset, "arm": arm, "link_key": name, "layer_split": w.split,
                             "exact_share": w.exact_share, "stock_even_s": stock_even,
                             "speedup_vs_stock_even": stock_even / r["ridgefill_s"], **r})
    return rows


def markdown(result: dict) -> str:
    w = result["workload"]
    lines = [f"# RidgeFill on a layer split: a model of the transfers ({result['date']})", "",
             f"Rate {result['rate_tmacs']:.0f} TMAC/s a device (calibrated: {result['calibration']}); "
             f"{w['n']:,} rows, tail {w['tail']}, ubatch "
             f"{w['ubatch']}, chunk {w['chunk']}. `even`: llama.cpp's default split by layers; `balanced`: contiguous "
             "ranges that share RidgeFill's work; `+overlap`: x_S sent and filled a ubatch at a time during sweep one, late "
             "units of a ubatch. Stock is timed on the even split; every pipeline keeps at most 4 units in flight.", ""]
    header = ["model (split S)", "exact share", "devices", "link", "RidgeFill's layer ranges", "stock, even split",
              "RidgeFill", "speedup", "busy (stock / RidgeFill)", "GB crossed (stock / RidgeFill)"]
    table = []
    for r in result["rows"]:
        b = r["bytes"]
        rf_bytes = b["sweep_one"] + b["x_split"] + b["late_units"]
        table.append([f"{r['preset']} (S {r['layer_split']})", r["exact_share"], r["devices"], r["link_key"],
                      f"{r['arm']} {r['bounds']}", f"{r['stock_even_s']:.2f} s", f"{r['ridgefill_s']:.2f} s",
                      f"{r['speedup_vs_stock_even']:.2f}x", f"{r['busy_stock']:.0%} / {r['busy_ridgefill']:.0%}",
                      f"{b['stock'] / GB:.1f} / {rf_bytes / GB:.1f}"])
    return "\n".join(lines + markdown_table(None, header, table)) + "\n"


def main(argv=None) -> None:
    from datetime import date

    from .bench import mac_counts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", type=Path, required=True, help="stem of the .json and .md files")
    ap.add_argument("--presets", default="qwen3-8b,gemma3-12b,qwen35-27b")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--exact-share", type=float, action="append", help="repeatable (default 0 and 0.24)")
    a = ap.parse_args(argv)
    # one H200's rate: the Gemma-3-12B shape's stock prefill of 32,768 rows took 6,033 ms (session 23)
    cal = REAL_SHAPES["gemma3-12b"]
    rate = mac_counts(cal, 32768, 16, 0, 0)["stock"] / 6.033
    rows = []
    for preset in a.presets.split(","):
        split = {"qwen3-8b": 13, "gemma3-12b": 16, "qwen35-27b": 16}.get(preset, REAL_SHAPES[preset].n_layer // 4)
        for share in a.exact_share or (0.0, 0.24):
            rows += plan(preset, Workload(n=a.tokens, split=split, exact_share=share), rate)
    result = {"date": str(date.today()), "rate_tmacs": rate / 1e12,
              "calibration": "Gemma-3-12B shape, Q8_0, stock prefill of 32,768 rows in 6,033 ms on one H200",
              "workload": dataclasses.asdict(Workload(n=a.tokens)), "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    for ext, text in (("json", json.dumps(result, indent=1)), ("md", markdown(result))):
        write_atomic(a.out.with_name(a.out.name + f".{ext}"), text)
    print(markdown(result))


if __name__ == "__main__":
    main()
