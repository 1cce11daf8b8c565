"""A soak of llama-server with RidgeFill: many requests of mixed lengths over several slots, RidgeFill on and off,
the prompt cache on and off, some cancelled in the middle of their prefill. It counts errors, samples the
server's resident memory, and replays every finished stock request on an upstream server (one slot, one request
at a time) and on the patched server alone (RidgeFill off, maps attached) to compare the generated text."""
from __future__ import annotations

import http.client
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .serve import Server


SOAK_LAYERS = {"llama": (4, 1), "qwen35": (8, 2)}  # layers and split; a hybrid needs a late recurrent layer


def soak_model(folder: Path, arch: str = "llama") -> tuple[Path, Path]:
    """The soak's tiny random model of `arch` and its random maps."""
    from .maps.synthetic import tiny_model_with_maps

    n_layer, split = SOAK_LAYERS[arch]
    return tiny_model_with_maps(folder, arch, n_layer=n_layer, split=split)


def plan(n: int, seed: int = 0, max_len: int = 1500) -> list[dict]:
    """The requests: prompt tokens, RidgeFill or not, cache or not, tokens to generate, a cancel delay, and the
    RidgeFill request's reuse policy (a quarter exact-only and a quarter rerank, which resume from the held split
    state where they can)."""
    rng = random.Random(seed)
    policy_rng = random.Random(seed + 1)  # its own draws, so the rest of the plan is what it was before it
    shared = [rng.randrange(1000, 20000) for _ in range(max_len)]  # a common document, so the cache is reused
    reqs = []
    for i in range(n):
        length = rng.choice([rng.randrange(8, 64), rng.randrange(64, 400), rng.randrange(400, max_len)])
        own = [rng.randrange(1000, 20000) for _ in range(length)]
        prompt = [1] + (shared[:length // 2] + own[:length - length // 2] if rng.random() < 0.5 else own)
        reqs.append({"i": i, "prompt": prompt, "ridgefill": rng.random() < 0.6, "cache_prompt": rng.random() < 0.5,
                     "n_predict": rng.randrange(1, 12),
                     "cancel_after_s": rng.uniform(0.0, 0.2) if rng.random() < 0.1 else None,
                     "reuse": resumed_or_any(policy_rng.random())})
    return reqs


def resumed_or_any(draw: float) -> str:
    return "exact-only" if draw < 0.25 else "rerank" if draw < 0.5 else "any"


def send(srv: Server, req: dict) -> dict:
    """One request; a cancelled one streams and closes the connection after its delay, counted from the request's
    sending: llama-server answers a stream's headers only with its first token, after the prefill."""
    body = {"prompt": req["prompt"], "n_predict": req["n_predict"], "temperature": 0,
            "cache_prompt": req["cache_prompt"], "ridgefill": req["ridgefill"], "ridgefill_reuse": req["reuse"]}
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=600)
    try:
        if req["cancel_after_s"] is not None:
            conn.request("POST", "/completion", json.dumps({**body, "stream": True}),
                         {"Content-Type": "application/json"})
            time.sleep(req["cancel_after_s"])
            return {"i": req["i"], "status": None, "cancelled": True}
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            return {"i": req["i"], "status": resp.status, "error": data[:300].decode(errors="replace")}
        out = json.loads(data)
        rf = out.get("timings", {}).get("ridgefill", {})
        return {"i": req["i"], "status": 200, "content": out.get("content", ""), "ridgefill_ran": "filled" in rf,
                "resumed": rf.get("resumed", 0)}
    except Exception as e:
        return {"i": req["i"], "status": -1, "error": f"{type(e).__name__}: {e}"}
    finally:
        conn.close()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def concurrent_run(srv: Server, reqs: list[dict], clients: int, log) -> tuple[list[dict], list, float]:
    """Every request from `clients` threads; the server's RSS after every 100."""
    results: list[dict] = []
    rss: list[tuple[int, float]] = []
    lock = threading.Lock()

    def one(req):
        r = send(srv, req)
        with lock:
            results.append(r)
            if len(results) % 100 == 0:
                rss.append((len(results), rss_mib(srv.proc.pid)))
                log(f"soak: {len(results)}/{len(reqs)} requests, server RSS {rss[-1][1]:.0f} MiB")
        return r

    t0 = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, reqs))
    return results, rss, time.monotonic() - t0


def run_soak(model, maps, *, n: int = 1000, slots: int = 4, clients: int = 8, threads: int = 2,
             n_ctx_slot: int = 2048, cache_ram_mib: int | None = None, log_dir: Path, log=print) -> dict:
    reqs = plan(n)
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    # the RAM prompt cache holds earlier prompts up to its limit: set it to 0 to see the server's own memory alone
    common = ("-kvu",) + (("--cache-ram", str(cache_ram_mib)) if cache_ram_mib is not None else ())
    extra = common + ("--metrics", "--ridgefill-select", "probe", "--ridgefill-probe-rows", "32")
    with Server(model, maps, tail=64, min_prefix=64, threads=threads, slots=slots, n_ctx=slots * n_ctx_slot,
                extra=extra, log_path=log_dir / "soak.server.log") as srv:
        results, rss, seconds = concurrent_run(srv, reqs, clients, log)
        alive = srv.proc.poll() is None and srv.get("/health").get("status") == "ok"
        metrics_text = _get_text(srv, "/metrics")
    # the same workload on upstream (which ignores the RidgeFill fields): how often batching alone moves the text
    with Server(model, None, build="upstream", threads=threads, slots=slots, n_ctx=slots * n_ctx_slot,
                extra=common, log_path=log_dir / "soak.upstream.log") as up:
        up_results, up_rss, _ = concurrent_run(up, reqs, clients, lambda *_: None)
    up_by_i = {r["i"]: r for r in up_results}
    by_i = {r["i"]: r for r in results}
    stock = [q for q in reqs if not q["ridgefill"] and q["cancel_after_s"] is None and by_i[q["i"]]["status"] == 200]
    # every finished stock request again, one at a time on one slot: on upstream and on the patched server with
    # the maps attached; the concurrent run's text can differ from both where batching moved a near tie
    alone = {}
    for build, m in (("upstream", None), ("ridgefill", maps)):
        with Server(model, m, build=build, threads=threads, slots=1, n_ctx=n_ctx_slot,
                    log_path=log_dir / f"soak.{build}-alone.log") as one_srv:
            alone[build] = {q["i"]: one_srv.post("/completion", {
                "prompt": q["prompt"], "n_predict": q["n_predict"], "temperature": 0, "cache_prompt": False,
                "ridgefill": False})["content"] for q in stock}
    off_vs_upstream = [i for i in alone["upstream"] if alone["upstream"][i] != alone["ridgefill"][i]]
    mismatched = [q["i"] for q in stock if by_i[q["i"]]["content"] != alone["upstream"][q["i"]]]
    up_mismatched = [q["i"] for q in stock if up_by_i[q["i"]].get("content") != alone["upstream"][q["i"]]]
    errors = [r for r in results if r["status"] != 200 and not r.get("cancelled")]
    # a client that leaves while its RidgeFill prefill runs cancels it, and the slot says so
    cancelled_in_flight = (log_dir / "soak.server.log").read_text(errors="replace").count("RidgeFill prefill cancelled")
    return {"requests": n, "slots": slots, "cache_ram_mib": cache_ram_mib, "clients": clients, "seconds": seconds, "server_alive": alive,
            "errors": errors, "cancelled": sum(1 for q in reqs if q["cancel_after_s"] is not None),
            "ridgefill_ran": sum(1 for r in results if r.get("ridgefill_ran")),
            "resumed": sum(1 for r in results if r.get("resumed")),
            "stock_compared": len(stock), "stock_mismatched": mismatched, "off_vs_upstream_alone": off_vs_upstream,
            "upstream_concurrent_mismatched": up_mismatched,
            "ridgefill_cancelled_in_flight": cancelled_in_flight,
            "rss_mib": rss, "upstream_rss_mib": up_rss,
            "metrics": [l for l in metrics_text.splitlines() if l.startswith("llamacpp:ridgefill")]}


def _get_text(srv: Server, path: str) -> str:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode(errors="replace")
    finally:
        conn.close()
