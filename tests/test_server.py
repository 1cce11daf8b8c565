"""llama-server with RidgeFill: flags and their environment variables, the per-request field, timings, and a
maps file that does not fit, which leaves the server serving stock."""
from __future__ import annotations

import dataclasses
import re
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, require_builds
from ridgefill_gguf.maps.convert import convert
from ridgefill_gguf.maps.synthetic import write_float_file
from ridgefill_gguf.random_gguf import tiny_shape, write_random_model
from ridgefill_gguf.serve import Server, ServerError, free_port
from test_reference_hybrid import long_memory_copy

PROMPT = "A long prompt for the server: every late layer's cache is written from a prediction. " * 30


@pytest.fixture(scope="module")
def model_and_maps(tmp_path_factory):
    d = tmp_path_factory.mktemp("server")
    shape = dataclasses.replace(tiny_shape("qwen3"), n_layer=4)
    model = write_random_model(d / "qwen3.gguf", shape, seed=5)
    src = write_float_file(d / "maps.safetensors", 1, [2, 3], shape.n_embd, dtype="f32")
    maps = convert(src, d / "maps.gguf", model=model).out
    bad = write_float_file(d / "bad.safetensors", 1, [2, 3], 2 * shape.n_embd, dtype="f32")
    bad_maps = convert(bad, d / "bad.gguf", arch="qwen3").out
    return model, maps, bad_maps, d


def test_a_long_prompt_is_prefilled_with_ridgefill_and_the_timings_say_how(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    with Server(model, maps, tail=64, min_prefix=0, threads=2, log_path=d / "on.log") as srv:
        on = srv.complete(PROMPT, n_predict=4)
        off = srv.complete(PROMPT, n_predict=4, ridgefill=False)
    rf = on["timings"]["ridgefill"]
    n_prompt = on["timings"]["prompt_n"]
    assert rf["split"] == 1 and rf["tail"] == 64
    assert rf["filled"] + rf["exact"] + rf["tail"] == n_prompt
    assert rf["filled"] > 0 and rf["total_ms"] > 0
    assert "ridgefill" not in off["timings"] and off["timings"]["prompt_n"] == n_prompt
    assert on["tokens_predicted"] == off["tokens_predicted"] == 4
    assert "RidgeFill on: split 1" in (d / "on.log").read_text()


def test_the_ridgefill_flags_can_come_from_the_environment(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    env = {"LLAMA_ARG_RIDGEFILL": str(maps), "LLAMA_ARG_RIDGEFILL_TAIL": "100",
           "LLAMA_ARG_RIDGEFILL_MIN_PREFIX": "0", "LLAMA_ARG_RIDGEFILL_SELECT": "none"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with Server(model, None, threads=2, log_path=d / "env.log") as srv:
            rf = srv.complete(PROMPT, n_predict=2)["timings"]["ridgefill"]
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert rf["tail"] == 100
    assert rf["select"] == "none"
    assert "RidgeFill on: split 1, fill ridge, tail 100, exact rows: none" in (d / "env.log").read_text()


def test_the_exact_row_selector_is_set_per_server_and_per_request(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    extra = ("--ridgefill-select", "probe", "--ridgefill-exact-share", "0.2", "--ridgefill-probe-rows", "32")
    with Server(model, maps, tail=64, min_prefix=0, threads=2, extra=extra, log_path=d / "select.log") as srv:
        probe = srv.complete(PROMPT, n_predict=2)["timings"]["ridgefill"]
        attention = srv.complete(PROMPT, n_predict=2, ridgefill_select="attention",
                                 ridgefill_exact_share=0.05)["timings"]["ridgefill"]
        plain = srv.complete(PROMPT, n_predict=2, ridgefill_select="none")["timings"]["ridgefill"]
        again = srv.complete(PROMPT, n_predict=2)["timings"]["ridgefill"]  # the server's setting comes back
        with pytest.raises(ServerError, match="ridgefill_select must be none, probe, attention, protected, random, "
                                              "blind-probe or blind-attention"):
            srv.complete(PROMPT, n_predict=2, ridgefill_select="magic")
    prefix = probe["filled"] + probe["exact"]
    assert probe["select"] == "probe" and probe["selected"] == round(0.2 * prefix) and probe["probe_ms"] > 0
    assert plain["select"] == "none" and plain["selected"] == 0 and plain["exact"] == plain["special"]
    assert attention["select"] == "attention" and attention["selected"] == 0  # split 1: no layer 3, 7, 11, 15 below
    assert again == {**again, "select": "probe", "selected": probe["selected"]}
    assert "exact rows: probe" in (d / "select.log").read_text()
    assert probe["budget"] == 0  # a share replaces the budget


def test_the_probe_counts_its_rows_by_the_budget_and_random_rows_match_that_count(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    extra = ("--ridgefill-select", "probe", "--ridgefill-probe-rows", "32", "--ridgefill-budget", "1")
    with Server(model, maps, tail=64, min_prefix=0, threads=2, extra=extra, research=True,
                log_path=d / "budget.log") as srv:
        probe = srv.complete("In 2024, 42 of 97 said so. " + PROMPT, n_predict=2)["timings"]["ridgefill"]
        half = srv.complete("In 2024, 42 of 97 said so. " + PROMPT, n_predict=2, ridgefill_budget=0.5)["timings"]["ridgefill"]
        rand = srv.complete("In 2024, 42 of 97 said so. " + PROMPT, n_predict=2, ridgefill_select="random")["timings"]["ridgefill"]
        blind = srv.complete("In 2024, 42 of 97 said so. " + PROMPT, n_predict=2,
                             ridgefill_select="blind-probe")["timings"]["ridgefill"]
    rules = probe["budget_rules"]
    assert probe["budget"] > 0 and rules["protected"] == 0 and rules["digits"] > 0  # no frequency table here
    # a number the probe keeps in part runs whole, on top of E
    assert probe["selected"] == probe["budget"] + probe["whole_numbers"]
    assert abs(half["budget"] - probe["budget"] / 2) <= 0.5
    assert rand["select"] == "random" and rand["selected"] == rand["budget"] == probe["budget"]
    # the question-blind control counts the same budget; its probe reads the prefix's last rows
    assert blind["select"] == "blind-probe" and blind["budget"] == probe["budget"] and blind["probe_ms"] > 0


def test_the_protected_selector_without_a_frequency_table_is_refused_by_name_and_the_request_runs_stock(
        model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    extra = ("--ridgefill-select", "protected")
    with Server(model, maps, tail=64, min_prefix=0, threads=2, extra=extra, log_path=d / "protected.log") as srv:
        first = srv.complete(PROMPT, n_predict=2)
        refused = srv.complete(PROMPT, n_predict=2, ridgefill_select="protected")
        probe = srv.complete("In 2024, 42 of 97 said so. " + PROMPT, n_predict=2,
                             ridgefill_select="probe")["timings"]["ridgefill"]
    log = (d / "protected.log").read_text()
    assert "RidgeFill selector 'protected' refused: " in log and "rf_token_freq" in log
    assert first["timings"]["ridgefill"]["select"] == "protected" and "refused" in first["timings"]["ridgefill"]
    assert "no token frequency table" in refused["timings"]["ridgefill"]["refused"]
    assert refused["tokens_predicted"] == 2 and probe["selected"] == probe["budget"] + probe["whole_numbers"] > 0


NUMBERS = "".join(f"Locker {k} opens with code {c}. " for k, c in [(31, 904417725513), (57, 662019384455),
                                                                    (83, 170034982216), (96, 550128847301)])


def test_whole_numbers_are_set_per_server_and_per_request(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    prompt = NUMBERS + PROMPT + "Locker 57 opens with which code?"
    probe = ("--ridgefill-select", "probe", "--ridgefill-probe-rows", "32")
    with Server(model, maps, tail=64, min_prefix=0, threads=2, extra=probe, log_path=d / "whole.log") as srv:
        on = srv.complete(prompt, n_predict=1)["timings"]["ridgefill"]
        off = srv.complete(prompt, n_predict=1, ridgefill_whole_numbers=False)["timings"]["ridgefill"]
        with pytest.raises(ServerError, match="ridgefill_whole_numbers must be true or false"):
            srv.complete(prompt, n_predict=1, ridgefill_whole_numbers="yes")
    extra = (*probe, "--ridgefill-whole-numbers", "off")
    with Server(model, maps, tail=64, min_prefix=0, threads=2, extra=extra, log_path=d / "whole-off.log") as srv:
        server_off = srv.complete(prompt, n_predict=1)["timings"]["ridgefill"]
        request_on = srv.complete(prompt, n_predict=1, ridgefill_whole_numbers=True)["timings"]["ridgefill"]
    assert on["whole_numbers"] > 0 and on["selected"] == on["budget"] + on["whole_numbers"]
    assert off["whole_numbers"] == 0 and off["selected"] == off["budget"] == on["budget"]
    assert server_off == {**server_off, "whole_numbers": 0, "selected": on["budget"]}
    assert request_on["whole_numbers"] == on["whole_numbers"]


def test_the_rescales_are_set_per_server_and_per_request(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    extra = ("--ridgefill-rescale", "values", "--ridgefill-rescale-rows", "16")
    with Server(model, maps, tail=64, min_prefix=0, threads=2, extra=extra, log_path=d / "rescale.log") as srv:
        values = srv.complete(PROMPT, n_predict=1, n_probs=1)
        plain = srv.complete(PROMPT, n_predict=1, n_probs=1, ridgefill_rescale="none")
        with pytest.raises(ServerError, match="ridgefill_rescale must be none, values, keys or both"):
            srv.complete(PROMPT, n_predict=2, ridgefill_rescale="half")
    assert values["timings"]["ridgefill"]["rescale"] == "values"
    assert plain["timings"]["ridgefill"]["rescale"] == "none"
    # the factors change what the tail reads: the first token's distribution moves
    p = values["completion_probabilities"][0]["top_logprobs"][0]["logprob"]
    q = plain["completion_probabilities"][0]["top_logprobs"][0]["logprob"]
    assert p != q


def test_a_maps_file_that_does_not_fit_is_refused_by_name_and_the_server_serves_stock(model_and_maps):
    require_builds("ridgefill")
    model, _, bad_maps, d = model_and_maps
    with Server(model, bad_maps, tail=64, min_prefix=0, threads=2, log_path=d / "bad.log") as srv:
        out = srv.complete(PROMPT, n_predict=3)
    # stock, and the request (which asks for RidgeFill by default) hears why it did not get it
    assert "refused at start" in out["timings"]["ridgefill"]["not_used"] and out["tokens_predicted"] == 3
    log = (d / "bad.log").read_text()
    assert "RidgeFill maps refused, serving without them" in log
    assert "a map is 128x128 (d_out x d_in), the model's residual stream is 64 wide" in log


def test_a_bad_flag_value_stops_the_server_with_the_reason(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    assert_refused_at_start(model, maps, d / "flag.log", "--ridgefill-fill must be ridge, identity or none, not "
                            "sometimes", fill="sometimes")


def assert_refused_at_start(model, maps, log, message: str, **kwargs) -> None:
    """The server stops while starting, and its log says why."""
    srv = Server(model, maps, log_path=log, startup_timeout=60, **kwargs)
    with pytest.raises(ServerError):
        srv.start()
    assert message in log.read_text()


def start_serve(model, maps, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ridgefill_gguf.cli", "serve", str(model), "--maps", str(maps),
                             "--port", str(port), "-t", "2"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def assert_no_server_left_on(port: int) -> None:
    """The server went with `serve` (a loaded machine may take a few seconds to reap it)."""
    deadline = time.monotonic() + 20
    while subprocess.run(["pgrep", "-f", f"llama-server.*--port {port}"], stdout=subprocess.PIPE).returncode != 1:
        assert time.monotonic() < deadline, "llama-server outlived `ridgefill-gguf serve`"
        time.sleep(0.5)


def test_ridgefill_gguf_serve_prints_where_it_listens(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, _ = model_and_maps
    port = free_port()
    proc = start_serve(model, maps, port)
    try:
        deadline, lines = time.monotonic() + 120, []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "listening on" in line:
                break
        assert any(f"llama-server listening on http://127.0.0.1:{port}" in line for line in lines), lines
        assert any("--ridgefill" in line and "-np 1" in line for line in lines), lines
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert_no_server_left_on(port)


def test_stopping_serve_while_the_server_starts_leaves_no_server_behind(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, _ = model_and_maps
    port = free_port()
    proc = start_serve(model, maps, port)
    assert proc.stdout.readline().startswith("starting: ")
    proc.terminate()  # while llama-server loads
    proc.wait(timeout=60)
    assert_no_server_left_on(port)


def test_llama_cli_takes_the_same_ridgefill_flags():
    require_builds("ridgefill")
    out = subprocess.run([str(ROOT / "build" / "ridgefill" / "bin" / "llama-cli"), "--help"], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60).stdout
    for flag in ("--ridgefill FNAME", "--ridgefill-tail N", "--ridgefill-maps", "--ridgefill-fill",
                 "--ridgefill-min-prefix N"):
        assert flag in out, flag
    assert "LLAMA_ARG_RIDGEFILL_TAIL" in out


@pytest.mark.parametrize("kv", ["-kvu", "--no-kv-unified"])
def test_parallel_slots_prefill_their_own_sequences_with_ridgefill(kv, model_and_maps):
    require_builds("ridgefill")
    import threading

    model, maps, _, d = model_and_maps
    # a later -np overrides serve's one slot
    with Server(model, maps, tail=32, min_prefix=0, threads=2, n_ctx=4096, extra=("-np", "2", kv),
                log_path=d / f"np2{kv}.log") as srv:
        out = {}
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, srv.complete(PROMPT + str(i), n_predict=4)))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        alone = srv.complete(PROMPT + "0", n_predict=4)
    assert all(out[i]["timings"]["ridgefill"]["filled"] > 0 for i in range(2))
    # the same prompt gives the same greedy tokens whether another sequence ran beside it or not
    assert out[0]["content"] == alone["content"]


def test_a_ridgefill_prefill_after_a_cached_prefix_gives_the_host_made_masks_probabilities(model_and_maps,
                                                                                          monkeypatch):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    prefix, suffix = PROMPT, "The suffix arrives later and is prefilled on top of the cached prefix. " * 20
    results = {}
    for name in ("device", "host"):
        if name == "host":  # sweep one with llama.cpp's own mask (patch 0017's switch)
            monkeypatch.setenv("LLAMA_RIDGEFILL_HOST_MASK", "1")
        with Server(model, maps, tail=32, min_prefix=0, threads=2, log_path=d / f"cached-{name}.log") as srv:
            first = srv.complete(prefix, n_predict=1, ridgefill=False, cache_prompt=True)
            results[name] = srv.complete(prefix + suffix, n_predict=4, cache_prompt=True, n_probs=5)
    device, host = results["device"], results["host"]
    # only the suffix was prefilled, with RidgeFill, over the cached prefix's cells (positions from the prefix on)
    assert device["timings"]["prompt_n"] < first["timings"]["prompt_n"]
    assert device["timings"]["ridgefill"]["filled"] > 0
    assert device["completion_probabilities"] == host["completion_probabilities"]


OTHER = "An unrelated long prompt takes the slot, so that the first one moves to the RAM prompt cache. " * 30


def top_logprob_gap(got: dict, want: dict) -> float:
    """The largest difference between two responses' top log-probabilities, in rank order (inf when the generated
    tokens differ; near-ties among the others may swap places)."""
    gaps = []
    for g, w in zip(got["completion_probabilities"], want["completion_probabilities"]):
        if g["id"] != w["id"]:
            return float("inf")
        gaps += [abs(x["logprob"] - y["logprob"]) for x, y in zip(g["top_logprobs"], w["top_logprobs"])]
    return max(gaps)


# a stock prefill that reuses a few cached rows moves the last bits (its ubatches start later): about 1e-4 here,
# where RidgeFill's approximated cells move the same numbers by about 7e-2
STOCK_NOISE = 1e-3


def test_a_stock_request_never_reuses_the_cells_a_ridgefill_request_approximated(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    log = d / "reuse.log"
    any_reuse = ("--ridgefill-reuse", "any")  # RidgeFill requests may reuse approximated cells (not the default)
    with Server(model, maps, tail=64, min_prefix=0, threads=2, extra=any_reuse, log_path=log) as srv:
        fresh = srv.complete(PROMPT, n_predict=4, ridgefill=False, n_probs=5)
        approx = srv.complete(PROMPT, n_predict=4, n_probs=5)
        follow_up = srv.complete(PROMPT, n_predict=4, n_probs=5, cache_prompt=True)
        stock = srv.complete(PROMPT, n_predict=4, n_probs=5, cache_prompt=True, ridgefill=False)
    n, k = fresh["timings"]["prompt_n"], stock["timings"]["cache_n"]
    assert approx["timings"]["ridgefill"]["filled"] > 0
    assert top_logprob_gap(approx, fresh) > 10 * STOCK_NOISE
    # a RidgeFill request may reuse the approximated cells (the chat follow-up on a long document)
    assert follow_up["timings"]["cache_n"] == n - 1
    assert follow_up["completion_probabilities"] == approx["completion_probabilities"]
    # the stock request reuses only the rows before the first filled one, and gets the stock prefill's numbers
    assert 0 < k <= n - approx["timings"]["ridgefill"]["filled"] - approx["timings"]["ridgefill"]["tail"]
    assert top_logprob_gap(stock, fresh) < STOCK_NOISE
    assert f"reusing {k} cached tokens, not the {n - k} RidgeFill approximated" in log.read_text()
    # each response says how many approximated positions it reused
    assert follow_up["timings"]["ridgefill"] == {"approx_reused": n - 1 - k}
    assert "ridgefill" not in stock["timings"]


def metric(srv: Server, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f"llamacpp:{name} "):
                return float(line.split()[1])
    raise AssertionError(f"llamacpp:{name} is not in /metrics")


def test_the_exact_only_policy_keeps_ridgefill_requests_off_approximated_cells_and_metrics_count_the_rest(
        model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    extra = ("--metrics", "--ridgefill-reuse", "any")
    with Server(model, maps, tail=64, min_prefix=0, threads=2, extra=extra, log_path=d / "any.log") as srv:
        srv.complete(PROMPT, n_predict=4)
        allowed = srv.complete(PROMPT, n_predict=4, cache_prompt=True)
        srv.complete(PROMPT, n_predict=4)
        refused = srv.complete(PROMPT, n_predict=4, cache_prompt=True, ridgefill_reuse="exact-only")
        with pytest.raises(ServerError, match="ridgefill_reuse must be any, exact-only or rerank, not 'sometimes'"):
            srv.complete(PROMPT, n_predict=1, ridgefill_reuse="sometimes")
        total = metric(srv, "ridgefill_approx_reused_total")
    env = {"LLAMA_ARG_RIDGEFILL_REUSE": "exact-only"}
    with Server(model, maps, tail=64, min_prefix=0, threads=2, env=env, log_path=d / "exact-only.log") as srv:
        srv.complete(PROMPT, n_predict=4)
        server_policy = srv.complete(PROMPT, n_predict=4, cache_prompt=True)
        request_any = srv.complete(PROMPT, n_predict=4, cache_prompt=True, ridgefill_reuse="any")
    n = allowed["timings"]["prompt_n"] + allowed["timings"]["cache_n"]
    # the rows after the first approximated one whose cells stay are prefilled again from their held split state
    k = refused["timings"]["cache_n"] - refused["timings"]["ridgefill"]["resumed"]
    assert allowed["timings"]["cache_n"] == n - 1 and allowed["timings"]["ridgefill"]["approx_reused"] == n - 1 - k
    # exact-only: the RidgeFill request re-prefills from the first approximated row, RidgeFill included
    assert 0 < k < n // 2 and refused["timings"]["ridgefill"]["filled"] > 0
    assert "approx_reused" not in refused["timings"]["ridgefill"]
    assert total == n - 1 - k
    assert server_policy["timings"]["cache_n"] - server_policy["timings"]["ridgefill"]["resumed"] == k
    assert request_any["timings"]["ridgefill"]["approx_reused"] > 0


FOLLOW_UP = " And a follow-up question about the document, asked in other words, comes after the first answer." * 3


def test_an_exact_only_follow_up_resumes_from_the_held_split_state_and_answers_as_one_that_cannot(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    log = d / "resume.log"
    ask = dict(n_predict=4, n_probs=5, cache_prompt=True, ridgefill_reuse="exact-only")
    with Server(model, maps, tail=64, min_prefix=0, threads=2, slots=2, extra=("--metrics",), log_path=log) as srv:
        srv.complete(PROMPT, n_predict=4, id_slot=0)
        resumed = srv.complete(PROMPT + FOLLOW_UP, id_slot=0, **ask)
        stock = srv.complete(PROMPT + FOLLOW_UP, n_predict=4, n_probs=5, ridgefill=False, cache_prompt=True, id_slot=0)
        srv.complete(PROMPT, n_predict=4, id_slot=0)
        srv.complete(OTHER, n_predict=2, id_slot=1)  # another RidgeFill prefill: the engine holds its rows now
        fresh = srv.complete(PROMPT + FOLLOW_UP, id_slot=0, **ask)
        # a follow-up that does not run RidgeFill after all (its selector is refused: these maps have no unigram
        # counts) drops the rows it kept and prefills them the stock way
        srv.complete(PROMPT, n_predict=4, id_slot=0)
        refused = srv.complete(PROMPT + FOLLOW_UP, id_slot=0, ridgefill_select="protected", **ask)
        counted = metric(srv, "ridgefill_rows_resumed_total")
    rf, rf_fresh = resumed["timings"]["ridgefill"], fresh["timings"]["ridgefill"]
    start = resumed["timings"]["cache_n"] - rf["resumed"]
    # the same first approximated row, the same rows prefilled with RidgeFill from it, all but the last 64 of
    # them (the budget scores their lower-layer attention) taken from the held split state the first time
    assert rf["resumed"] > 0 and rf_fresh["resumed"] == 0
    assert start == fresh["timings"]["cache_n"] and rf["rows"] == rf_fresh["rows"]
    assert rf["resumed"] == rf["rows"] - 64 and counted == rf["resumed"]
    assert f"({rf['resumed']} resumed from the held split state)" in log.read_text()
    # what it answers is what the prefill that ran every row's lower layers again answers, to float noise
    assert top_logprob_gap(resumed, fresh) < STOCK_NOISE
    # a stock request right after it does not reuse the resumed rows as exact ones
    assert stock["timings"]["cache_n"] <= start
    assert "refused" in refused["timings"]["ridgefill"] and refused["timings"]["cache_n"] == start
    assert top_logprob_gap(refused, stock) < STOCK_NOISE


def test_a_rerank_follow_up_keeps_exact_the_rows_the_first_prefill_ran_exactly_and_ranks_the_rest_again(
        model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    ask = dict(n_predict=4, cache_prompt=True, id_slot=0)
    env = {"LLAMA_ARG_RIDGEFILL_REUSE": "rerank"}
    with Server(model, maps, tail=64, min_prefix=0, threads=2, env=env, log_path=d / "rerank.log") as srv:
        first = srv.complete(PROMPT, n_predict=4, id_slot=0)
        rerank = srv.complete(PROMPT + FOLLOW_UP, **ask)
        srv.complete(PROMPT, n_predict=4, id_slot=0)
        exact_only = srv.complete(PROMPT + FOLLOW_UP, ridgefill_reuse="exact-only", **ask)
        props = srv.get("/props")["ridgefill"]
    rf, rf_first, rf_exact_only = (r["timings"]["ridgefill"] for r in (rerank, first, exact_only))
    assert props["reuse"] == "rerank"
    # both prefill again from the first approximated row over the held split state, the same rows
    assert rf["resumed"] == rf_exact_only["resumed"] > 0 and rf["rows"] == rf_exact_only["rows"]
    assert "approx_reused" not in rf
    # rerank keeps the first prefill's exact rows that the new ranking alone leaves filled, on top of its own
    assert rf["kept_exact"] > 0 and rf_exact_only["kept_exact"] == 0 and rf_first["kept_exact"] == 0
    assert rf["exact"] - rf["kept_exact"] - rf["selected"] == rf_exact_only["exact"] - rf_exact_only["selected"]
    assert rf["exact"] > rf_exact_only["exact"]


def test_the_ram_prompt_cache_and_slot_files_carry_which_cells_are_approximated(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    saves = d / "slot-saves"
    saves.mkdir(exist_ok=True)
    with Server(model, maps, tail=64, min_prefix=0, threads=2, log_path=d / "ram-cache.log",
                extra=("--cache-ram", "64", "--slot-save-path", str(saves))) as srv:
        fresh = srv.complete(PROMPT, n_predict=4, ridgefill=False, n_probs=5)
        approx = srv.complete(PROMPT, n_predict=4, n_probs=5)
        srv.complete(OTHER, n_predict=2, ridgefill=False)  # the slot's prompt goes to the RAM cache
        from_ram = srv.complete(PROMPT, n_predict=4, n_probs=5, cache_prompt=True, ridgefill=False)

        srv.complete(PROMPT, n_predict=4)  # RidgeFill again, then the slot to a file and back
        srv.post("/slots/0?action=save", {"filename": "approx.bin"})
        marks = (saves / "approx.bin.ridgefill").read_text()
        srv.post("/slots/0?action=erase", {})
        srv.post("/slots/0?action=restore", {"filename": "approx.bin"})
        from_file = srv.complete(PROMPT, n_predict=4, n_probs=5, cache_prompt=True, ridgefill=False)
    n = fresh["timings"]["prompt_n"]
    assert top_logprob_gap(approx, fresh) > 10 * STOCK_NOISE
    k = from_ram["timings"]["cache_n"]
    assert 0 < k <= n - approx["timings"]["ridgefill"]["filled"] - approx["timings"]["ridgefill"]["tail"]
    assert marks == f"approx_from {k}\n"
    for got in (from_ram, from_file):
        assert got["timings"]["cache_n"] == k
        assert top_logprob_gap(got, fresh) < STOCK_NOISE


def test_cache_reuse_by_shifting_moves_the_mark_of_the_approximated_cells_with_them(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    sentences = [f"Sentence {w} of the exact prefix is plain text." for w in
                 ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")]
    a = " ".join(sentences) + " " + " ".join(sentences)
    a_cut = " ".join(sentences[:4] + sentences[5:]) + " " + " ".join(sentences)
    b = " The RidgeFill part follows the exact prefix and is approximated." * 20
    extra = ("--cache-reuse", "8", "--ridgefill-select", "none", "--ridgefill-reuse", "any")
    with Server(model, maps, tail=32, min_prefix=0, threads=2, extra=extra, log_path=d / "shift.log") as srv:
        tok = lambda text: srv.post("/tokenize", {"content": text, "add_special": True})["tokens"]  # noqa: E731
        srv.complete(a, n_predict=1, ridgefill=False, cache_prompt=True)
        approx = srv.complete(a + b, n_predict=1, cache_prompt=True)  # RidgeFill over the cached exact prefix
        srv.complete(a_cut + b, n_predict=1, cache_prompt=True)  # a RidgeFill request: chunks shift left
        stock = srv.complete(a_cut + b, n_predict=4, n_probs=5, cache_prompt=True, ridgefill=False)
        fresh = srv.complete(a_cut + b, n_predict=4, n_probs=5, ridgefill=False)
        removed = len(tok(a)) - len(tok(a_cut))
    assert approx["timings"]["ridgefill"]["filled"] > 0 and removed > 0
    # the approximated cells began right after the exact prefix, and moved left with their chunk: the stock request
    # reuses the exact prefix as shifted (upstream's own approximation, so its numbers are not a fresh prefill's)
    # and not one approximated cell
    assert stock["timings"]["cache_n"] == approx["timings"]["cache_n"] - removed
    assert stock["timings"]["prompt_n"] == fresh["timings"]["prompt_n"] - stock["timings"]["cache_n"]


def test_props_show_the_ridgefill_settings_and_slots_show_where_approximated_cells_begin(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    with Server(model, maps, tail=64, min_prefix=0, threads=2, log_path=d / "props.log") as srv:
        props = srv.get("/props")["ridgefill"]
        before = srv.get("/slots")[0]["ridgefill_approx_from"]
        srv.complete(PROMPT, n_predict=2)
        after = srv.get("/slots")[0]["ridgefill_approx_from"]
        srv.complete(PROMPT, n_predict=2, ridgefill=False)
        stock = srv.get("/slots")[0]["ridgefill_approx_from"]
    with Server(model, None, threads=2, log_path=d / "props-off.log") as srv:
        off = srv.get("/props").get("ridgefill")
    # the server's defaults, which the eval instruments and advise take as their own
    from ridgefill_gguf.advise import SERVER_REUSE
    from ridgefill_gguf.eval.arms import SERVER_BUDGET
    assert props == {**props, "maps": str(maps), "placement": "resident", "tail": 64, "min_prefix": 0,
                     "select": "probe", "budget": SERVER_BUDGET, "reuse": SERVER_REUSE, "whole_numbers": True}
    # what was loaded, read from the file: its split, layers and the checksum that identifies it
    from ridgefill_gguf.gguf_io import read_gguf

    assert props["attached"] is True
    assert props["loaded"] == {"file": str(maps), "split": 1, "layers": 2, "state_delta_layers": 0,
                               "tensor_data_sha256": read_gguf(maps).get("ridgefill.tensor_data_sha256")}
    assert before == -1 and after >= 1 and stock == -1  # the stock prefill (no cache) left only exact cells
    assert off is None



def test_the_eval_instruments_take_the_servers_budget_on_a_model_without_sliding_window_layers(model_and_maps):
    from ridgefill_gguf.cli import _model_budget_default
    from ridgefill_gguf.eval.arms import SERVER_BUDGET

    require_builds("ridgefill")
    model, _, _, _ = model_and_maps
    assert _model_budget_default(model) == SERVER_BUDGET == 1.5

def test_a_request_that_asked_for_ridgefill_and_got_the_stock_prefill_says_why(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    log = d / "not-used.log"
    with Server(model, maps, tail=64, threads=2, log_path=log) as srv:  # min_prefix: the engine's 256
        short = srv.complete("A short prompt. " * 40, n_predict=2)
        asked_off = srv.complete("A short prompt. " * 40, n_predict=2, ridgefill=False)
    why = short["timings"]["ridgefill"]["not_used"]
    assert short["timings"]["ridgefill"] == {"not_used": why} and "shorter than min_prefix 256" in why
    assert "ridgefill" not in asked_off["timings"]
    lines = [x for x in log.read_text().splitlines() if "RidgeFill not used" in x]
    assert len(lines) == 1 and " I slot " in lines[0] and why in lines[0]


@pytest.fixture(scope="module")
def hybrid_and_maps(tmp_path_factory):
    """An 8-layer qwen35 (Gated DeltaNet 0-2 and 4-6, attention 3 and 7) whose states remember, and maps at
    split 2."""
    d = tmp_path_factory.mktemp("server-hybrid")
    shape = dataclasses.replace(tiny_shape("qwen35"), n_layer=8)
    model = long_memory_copy(write_random_model(d / "stock.gguf", shape, seed=5), d / "qwen35.gguf")
    src = write_float_file(d / "maps.safetensors", 2, list(range(3, 8)), shape.n_embd, dtype="f32")
    return model, convert(src, d / "maps.gguf", model=model).out, d


def test_a_hybrid_restores_checkpoints_of_approximated_state_only_for_requests_that_may_reuse_them(
        hybrid_and_maps):
    # a hybrid cannot roll its recurrent state back, so reusing a cached prompt restores a context checkpoint;
    # those written after a RidgeFill prefill hold the states the filled rows carried
    require_builds("ridgefill")
    model, maps, d = hybrid_and_maps
    log = d / "checkpoints.log"
    extra = ("--metrics", "--ridgefill-reuse", "any")
    with Server(model, maps, tail=64, min_prefix=0, threads=2, extra=extra, log_path=log) as srv:
        fresh = srv.complete(PROMPT, n_predict=4, ridgefill=False, n_probs=5)
        approx = srv.complete(PROMPT, n_predict=4, n_probs=5)
        follow_up = srv.complete(PROMPT, n_predict=4, n_probs=5, cache_prompt=True)
        stock = srv.complete(PROMPT, n_predict=4, n_probs=5, cache_prompt=True, ridgefill=False)
        restored = metric(srv, "ridgefill_approx_checkpoints_total")
    assert approx["timings"]["ridgefill"]["filled"] > 0
    assert top_logprob_gap(approx, fresh) > 10 * STOCK_NOISE
    # the RidgeFill follow-up restores the checkpoint of approximated state, and says so
    assert follow_up["timings"]["cache_n"] > 0
    assert follow_up["timings"]["ridgefill"]["approx_checkpoints"] == 1 and restored == 1
    assert follow_up["completion_probabilities"] == approx["completion_probabilities"]
    # the stock request restores none of them: it prefills the prompt again and gets the stock numbers
    assert stock["timings"]["cache_n"] == 0
    assert top_logprob_gap(stock, fresh) < STOCK_NOISE
    assert "ridgefill" not in stock["timings"]


def test_a_hybrids_exact_only_follow_up_resumes_with_the_states_its_rows_left_and_answers_as_one_that_cannot(
        hybrid_and_maps):
    # a hybrid's recurrent state cannot go back, so the engine keeps the states the first prefill's rows left below
    # the split, and the follow-up resumes over all of them from position 0 instead of looking for a checkpoint
    require_builds("ridgefill")
    model, maps, d = hybrid_and_maps
    log = d / "hybrid-resume.log"
    ask = dict(n_predict=4, n_probs=5, cache_prompt=True, ridgefill_reuse="exact-only")
    follow_up = PROMPT + FOLLOW_UP * 2  # more than the 64 rows the budget scores in sweep one after the held ones
    with Server(model, maps, tail=64, min_prefix=0, threads=2, slots=2, extra=("--metrics",), log_path=log) as srv:
        first = srv.complete(PROMPT, n_predict=4, id_slot=0)
        resumed = srv.complete(follow_up, id_slot=0, **ask)
        srv.complete(PROMPT, n_predict=4, id_slot=0)
        srv.complete(PROMPT, n_predict=2, id_slot=1)  # another slot's RidgeFill prefill: the engine holds its rows now
        fresh = srv.complete(follow_up, id_slot=0, **ask)
        counted = metric(srv, "ridgefill_rows_resumed_total")
    rf, rf_fresh = resumed["timings"]["ridgefill"], fresh["timings"]["ridgefill"]
    assert rf["resumed"] == first["timings"]["ridgefill"]["rows"] > 0 and rf_fresh["resumed"] == 0
    assert counted == rf["resumed"] and f"({rf['resumed']} resumed from the held split state)" in log.read_text()
    assert resumed["timings"]["cache_n"] == rf["resumed"] and fresh["timings"]["cache_n"] == 0
    assert rf["rows"] == rf_fresh["rows"]
    assert top_logprob_gap(resumed, fresh) < STOCK_NOISE


def test_a_hybrid_request_whose_prompt_fits_the_rows_kept_for_its_checkpoint_says_why_it_got_the_stock_prefill(
        hybrid_and_maps):
    # a hybrid's slot prefills a prompt's last 4 + ubatch rows the stock way, to checkpoint its state before them
    require_builds("ridgefill")
    model, maps, d = hybrid_and_maps
    with Server(model, maps, tail=64, min_prefix=0, threads=2, extra=("--metrics",),
                log_path=d / "hybrid-short.log") as srv:
        short = srv.complete("A short prompt. " * 60, n_predict=1)
        long = srv.complete(PROMPT, n_predict=1)
        fallbacks = metric(srv, 'ridgefill_fallbacks_total{reason="short_prompt"}')
    why = short["timings"]["ridgefill"]["not_used"]
    assert "no more than the 516 the server prefills the stock way" in why, why
    assert long["timings"]["ridgefill"]["filled"] > 0 and fallbacks == 1
    assert any("RidgeFill not used" in x and why in x for x in (d / "hybrid-short.log").read_text().splitlines())


def test_the_terminal_state_correction_is_set_per_server_and_per_request_and_counted(hybrid_and_maps):
    import numpy as np

    from ridgefill_gguf.maps.state_delta import write_state_deltas

    require_builds("ridgefill")
    model, maps, d = hybrid_and_maps
    shape = dataclasses.replace(tiny_shape("qwen35"), n_layer=8)
    state = shape.recurrent_state_shape
    corrected = write_state_deltas(maps, {il: np.full(state, 0.01, np.float32) for il in (4, 5, 6)},
                                   d / "corrected.gguf")
    with Server(model, corrected, tail=64, min_prefix=0, threads=2, log_path=d / "state-off.log") as srv:
        default = srv.complete(PROMPT, n_predict=1)
        asked = srv.complete(PROMPT, n_predict=1, ridgefill_state_correction=True)
        with pytest.raises(ServerError, match="ridgefill_state_correction must be true or false"):
            srv.complete(PROMPT, n_predict=1, ridgefill_state_correction="yes")
    env = {"LLAMA_ARG_RIDGEFILL_STATE_CORRECTION": "on"}
    with Server(model, corrected, tail=64, min_prefix=0, threads=2, env=env, log_path=d / "state-on.log") as srv:
        on = srv.complete(PROMPT, n_predict=1)
        declined = srv.complete(PROMPT, n_predict=1, ridgefill_state_correction=False)
        props = srv.get("/props")["ridgefill"]
    assert default["timings"]["ridgefill"]["state_corrected"] == 0
    assert asked["timings"]["ridgefill"]["state_corrected"] == 3  # layers 4-6; the split's layer 2 has no offset
    assert on["timings"]["ridgefill"]["state_corrected"] == 3
    assert declined["timings"]["ridgefill"]["state_corrected"] == 0
    assert props["state_correction"] is True


def test_metrics_count_ridgefill_prefills_their_rows_and_the_fallbacks_by_reason(model_and_maps):
    import urllib.request

    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    with Server(model, maps, tail=64, threads=2, extra=("--metrics",), log_path=d / "metrics.log") as srv:
        long = srv.complete(PROMPT, n_predict=1)
        short = srv.complete("A short prompt.", n_predict=1)
        with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        counts = {name: metric(srv, name) for name in ("ridgefill_prefills_total", "ridgefill_rows_filled_total",
                                                       "ridgefill_rows_exact_total")}
    rf = long["timings"]["ridgefill"]
    assert counts == {"ridgefill_prefills_total": 1, "ridgefill_rows_filled_total": rf["filled"],
                      "ridgefill_rows_exact_total": rf["exact"] + rf["tail"]}
    assert "shorter than min_prefix" in short["timings"]["ridgefill"]["not_used"]
    assert 'llamacpp:ridgefill_fallbacks_total{reason="short_prompt"} 1' in text


def test_research_controls_are_refused_by_name_unless_the_server_runs_for_research(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    assert_refused_at_start(model, maps, d / "research-fill.log",
                            "--ridgefill-fill none is a research control, not a serving mode", fill="none")
    with Server(model, maps, tail=64, min_prefix=0, threads=2, log_path=d / "research.log") as srv:
        for select in ("random", "blind-probe"):
            with pytest.raises(ServerError, match=f"ridgefill_select {select} is a research control"):
                srv.complete(PROMPT, n_predict=1, ridgefill_select=select)
        assert srv.complete(PROMPT, n_predict=1, ridgefill_select="none")["timings"]["ridgefill"]["filled"] > 0
    with Server(model, maps, fill="identity", tail=64, min_prefix=0, threads=2, research=True,
                log_path=d / "research-on.log") as srv:
        assert srv.complete(PROMPT, n_predict=1, ridgefill_select="random")["timings"]["ridgefill"]["select"] == "random"


BAD_REQUEST_FIELDS = [  # (field, a bad value) for every RidgeFill field a request may carry
    ("ridgefill", "yes"), ("ridgefill", 3),
    ("ridgefill_select", "magic"), ("ridgefill_select", 1),
    ("ridgefill_rescale", "all"),
    ("ridgefill_whole_numbers", "yes"),
    ("ridgefill_state_correction", 1),
    ("ridgefill_reuse", "sometimes"),
    ("ridgefill_exact_share", 1.5), ("ridgefill_exact_share", -0.1), ("ridgefill_exact_share", "half"),
    ("ridgefill_budget", -1), ("ridgefill_budget", 1e9), ("ridgefill_budget", [1]),
]


def test_every_ridgefill_request_field_rejects_a_bad_value_with_http_400_naming_the_field(model_and_maps):
    require_builds("ridgefill")
    model, maps, _, d = model_and_maps
    with Server(model, maps, tail=64, min_prefix=0, threads=2, log_path=d / "bad-fields.log") as srv:
        for field, value in BAD_REQUEST_FIELDS:
            with pytest.raises(ServerError) as e:
                srv.post("/completion", {"prompt": PROMPT, "n_predict": 1, field: value})
            assert "HTTP 400: " in str(e.value) and f"Field '{field}'" in str(e.value), (field, value, str(e.value))
        ok = srv.complete(PROMPT, n_predict=2, ridgefill_exact_share=0.5, ridgefill_budget=2)  # still serving
    assert ok["timings"]["ridgefill"]["filled"] > 0, ok["timings"]


@pytest.mark.parametrize("way", ["maps_refused", "speculative", "not_completion"])
def test_a_request_that_asked_for_ridgefill_and_got_the_stock_prefill_says_why_in_the_log_and_metrics(
        model_and_maps, way):
    require_builds("ridgefill")
    model, maps, bad_maps, d = model_and_maps
    extra = {"maps_refused": (), "speculative": ("--spec-type", "ngram-simple"), "not_completion": ("--embeddings", "-b", "2048", "-ub", "2048")}[way]
    log_path = d / f"fallback-{way}.log"
    with Server(model, bad_maps if way == "maps_refused" else maps, tail=64, min_prefix=0, threads=2,
                extra=("--metrics", *extra), log_path=log_path) as srv:
        if way == "not_completion":
            out = srv.post("/embedding", {"content": PROMPT})
        else:
            out = srv.complete(PROMPT, n_predict=2)
        fallbacks = metric(srv, f'ridgefill_fallbacks_total{{reason="{way}"}}')
    why = {"maps_refused": "refused at start", "speculative": "speculative decoding",
           "not_completion": "not a completion"}[way]
    assert fallbacks == 1, fallbacks
    assert re.search(r" I slot .*RidgeFill not used, prefilling the stock way: .*" + why, log_path.read_text())
    if way == "not_completion":  # an embedding has no timings: /embedding's items say it (/v1/embeddings' format is
        assert out[0]["ridgefill"]["not_used"] == why and len(out[0]["embedding"][0]) > 0, out  # OpenAI's)
    else:
        assert why in out["timings"]["ridgefill"]["not_used"] and out["tokens_predicted"] == 2, out["timings"]
