"""Device memory of long-prompt prefills: upstream's llama-server against the patched one with RidgeFill maps,
resident and streamed, per prompt length, one server at a time on the device.

Each server gets a context of the prompt's length. Its memory in use once loaded, the peak while each request runs
(stock; plain RidgeFill; RidgeFill with the server's default selector, the probe) and the request's prompt time are
recorded, then the memory breakdown llama.cpp prints when the server exits (model, context and compute memory per
device: the maps count as model memory, RidgeFill's buffers as context memory).
"""
from __future__ import annotations

import datetime as dt
import json
import re
import time
from pathlib import Path
from typing import Callable

from .bench import DeviceMemory, build_identity, default_text, markdown_table, timed
from .serve import Server
from .util import hardware, write_atomic

_GPU_ROW = re.compile(r"\|\s+- (\S+) \((.*?)\)\s*\|\s*(\d+)\s*=\s*(\d+)\s*\+\s*\(\s*(\d+)\s*=\s*(\d+)\s*\+\s*(\d+)\s*\+"
                      r"\s*(\d+)\s*\)\s*\+\s*(-?\d+)")
_COMPUTE_GREW = re.compile(r"(\S+) compute buffer size of\s+([\d.]+) MiB, does not match expectation of\s+([\d.]+) MiB")
_HOST_ROW = re.compile(r"\|\s+- Host\s*\|\s*(\d+)\s*=\s*(\d+)\s*\+\s*(\d+)\s*\+\s*(\d+)")

# the arms each patched server runs, as request fields; upstream runs the stock one only
ARMS = {"stock": {"ridgefill": False}, "plain": {"ridgefill": True, "ridgefill_select": "none"},
        "probe": {"ridgefill": True, "ridgefill_select": "probe"}}


def parse_breakdown(log: str) -> dict[str, dict[str, int]]:
    """The last memory breakdown in a llama.cpp log, MiB per device and for the host:
    {"CUDA0": {"total", "free", "self", "model", "context", "compute", "unaccounted"}, "Host": {...}}."""
    keys = ("total", "free", "self", "model", "context", "compute", "unaccounted")
    out: dict[str, dict[str, int]] = {}
    for m in _GPU_ROW.finditer(log):
        out[m.group(1)] = dict(zip(keys, map(int, m.groups()[2:])))
    hosts = _HOST_ROW.findall(log)
    if hosts:
        out["Host"] = dict(zip(("self", "model", "context", "compute"), map(int, hosts[-1])))
    return out


def compute_growth(log: str) -> dict[str, dict[str, float]]:
    """Compute buffers that outgrew llama.cpp's reservation, as the context reports when it is freed:
    {"CUDA0": {"held_mib", "reserved_mib"}}."""
    return {m.group(1): {"held_mib": float(m.group(2)), "reserved_mib": float(m.group(3))}
            for m in _COMPUTE_GREW.finditer(log)}


def _one_server(srv: Server, mem: DeviceMemory, tokens: list[int], arms: list[str], log: Callable[[str], None],
                label: str) -> dict:
    t_up = time.monotonic()
    time.sleep(1.0)
    row: dict = {"loaded_mib": mem.peak(t_up, time.monotonic()), "arms": {}}
    srv.complete(tokens[:512], n_predict=1, ridgefill=False)  # warm-up, short: kernels loaded, no long allocations
    for arm in arms:
        r, peak = timed(mem, lambda: srv.complete(tokens, n_predict=1, **ARMS[arm]))
        t = r["timings"]
        rf = t.get("ridgefill") or {}
        if arm != "stock" and "filled" not in rf:
            raise RuntimeError(f"{label} {arm}: the server did not use RidgeFill ({rf}); see {srv.log_path}")
        row["arms"][arm] = {"prompt_ms": t["prompt_ms"], "peak_mib": peak,
                            "rows": {k: rf[k] for k in ("filled", "exact", "tail", "masks_made") if k in rf}}
        log(f"memory bench: {label} {len(tokens)} tokens, {arm}: {t['prompt_ms']:.0f} ms, peak {peak} MiB")
    return row


def run_memory_bench(model: str | Path, maps: str | Path, lengths: list[int], *, tail: int = 4096,
                     placements: tuple[str, ...] = ("resident", "streamed"), n_gpu_layers: int | None = 99,
                     threads: int | None = None, out_dir: str | Path = "results/bench", label: str | None = None,
                     extra: tuple[str, ...] = (), baseline: str = "upstream",
                     log: Callable[[str], None] = print) -> dict:
    """baseline: "upstream" (upstream's build) or "no-maps" (the patched build without maps, where RidgeFill is off
    and allocates nothing), the stock server the patched ones are measured against."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = default_text(6 * max(lengths))
    result = {"benchmark": "device memory of a prefill, upstream against RidgeFill", "date": dt.date.today().isoformat(),
              "hardware": hardware(), "model": str(model), "maps": str(maps), "tail": tail, "lengths": lengths,
              "baseline": baseline, "build": build_identity(), "rows": [], "commands": {}}
    stem = f"{result['date']}-{label or Path(model).stem}-memory"

    def save() -> None:
        write_atomic(out_dir / f"{stem}.json", json.dumps(result, indent=2) + "\n")
        write_atomic(out_dir / f"{stem}.md", markdown(result))

    with DeviceMemory() as mem:
        for n in lengths:
            for server in (baseline, *placements):
                common = dict(n_ctx=n + 64, threads=threads, n_gpu_layers=n_gpu_layers, extra=(*extra, "-lv", "4"),
                              log_path=out_dir / f"server-memory-{server}-{n}.log")
                srv = (Server(model, build="upstream" if server == "upstream" else "ridgefill", **common)
                       if server == baseline else
                       Server(model, maps, tail=tail, placement=server, min_prefix=0, **common))
                with srv:
                    tokens = srv.post("/tokenize", {"content": text, "add_special": True})["tokens"][:n]
                    if len(tokens) < n:
                        raise ValueError(f"the text gives {len(tokens)} tokens, fewer than {n}")
                    row = _one_server(srv, mem, tokens, ["stock"] if server == baseline else list(ARMS), log,
                                      server)
                    result["commands"][f"{server}-{n}"] = " ".join(srv.command)
                server_log = srv.log_path.read_text(errors="replace")
                row.update({"server": server, "tokens": n, "breakdown_mib": parse_breakdown(server_log),
                            "compute_grew": compute_growth(server_log)})
                result["rows"].append(row)
                save()
    result["files"] = [str(out_dir / f"{stem}.{ext}") for ext in ("json", "md")]
    return result


def markdown(r: dict) -> str:
    lines = [f"# Device memory of a prefill, upstream against RidgeFill ({r['date']})", "",
             f"Model `{Path(r['model']).name}`, maps `{Path(r['maps']).name}`, tail {r['tail']}; "
             f"hardware: {r['hardware']}.", "",
             "One server at a time, a context of the prompt's length. MiB in use on the device (nvidia-smi): once "
             "loaded, and the peak while each request ran; then the breakdown the server printed on exit "
             "(the maps are model memory, RidgeFill's buffers context memory).", ""]
    table = []
    for row in r["rows"]:
        dev = next((v for k, v in row["breakdown_mib"].items() if k != "Host"), {})
        grew = next(iter(row.get("compute_grew", {}).values()), {})
        for arm, a in row["arms"].items():
            table.append([row["tokens"], row["server"], arm, row["loaded_mib"], a["peak_mib"], f"{a['prompt_ms']:.0f}",
                          a["rows"].get("masks_made", ""), dev.get("model", ""), dev.get("context", ""),
                          dev.get("compute", ""), grew.get("held_mib", "")])
    lines += markdown_table(None, ["tokens", "server", "request", "loaded", "peak", "prompt ms", "masks made",
                                   "model", "context", "compute (breakdown)", "compute held at exit"], table)
    lines += ["", "The breakdown is the last one the server printed (at exit); \"compute held at exit\" is the "
              "compute buffer the context held when freed, where it had outgrown llama.cpp's reservation."]
    lines += ["", "Commands:", ""] + [f"- {k}: `{v}`" for k, v in r["commands"].items()]
    return "\n".join(lines) + "\n"
