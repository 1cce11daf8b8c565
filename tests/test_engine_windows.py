"""Sliding-window models (gemma3) through the engine on the CPU.

A tiny random gemma3 (two windowed layers of window 32, then a global one, twice) at split 2: the late layers 3, 4
(windowed) and 5 (global), prompts of 230 rows, so that the prefix, the tail (40 rows) and the exact rows all
reach past the window. llama.cpp keeps the windowed layers' cells in a cache of their own (llama_kv_cache_iswa);
the late layers read and write the cache their layer is in.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_bytes_differ, assert_same_bytes, require_builds
from ridgefill_gguf.maps.convert import convert
from ridgefill_gguf.maps.synthetic import write_float_file
from ridgefill_gguf.random_gguf import tiny_shape, write_random_model
from test_engine_prefill import TEXT, TIGHT, kl, reference_and_maps, run_engine

SPLIT, LATE = 2, [3, 4, 5]
FULL = {"swa_full": True}  # the windowed layers' cache keeps every row (the library's default, llama-server's --swa-full)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine-windows")
    shape = tiny_shape("gemma3")
    assert [shape.is_swa(il) for il in range(shape.n_layer)] == [True, True, False, True, True, False]
    model = write_random_model(d / "gemma3.gguf", shape, seed=3)
    src = write_float_file(d / "gemma3.safetensors", SPLIT, LATE, shape.n_embd, dtype="f32", seed=4)
    return model, convert(src, d / "gemma3.maps.gguf", model=model, outtype="f32").out


# llama-server's default: the windowed layers keep a window and a ubatch of cells (256 here) under a global cache of
# 1,024, and the prompt is 690 rows, so that the late windowed layers reuse the cells as a ring
ONE_WINDOW = {"swa_full": False}
RING_PROMPT, RING_CTX = TEXT * 3, 1024


# a full first chunk (32 rows), then a chunk from row 100 whose rows and windows span the ring exactly (row 325 and
# the window before row 100, [69, 325], take 257 cells of 256 if the chunk held both)
RING_ROWS = [*range(1, 32), 100, 325, 400, 520]


def largest_move(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.float64) - b).max())


# The ring holds a window's cells in another order than the full cache, which moves stock's own logits in their
# last bits on an AVX2 CPU (the AVX-512 machines gave the same bytes with F16 cells). Each arm may move up to 4 times
# stock's move, or a small share of the logits' scale where stock does not move (measured on AVX2 with F32 cells, at
# the decode step: stock 3.7e-7, the arms up to 7.6e-7, a chunk one row too long 2.5e-5, about 3e-5 of the scale).
RING_F32 = {"f32_cache": True}


def assert_moves_about_as_much_as_stock(ring: dict, full: dict, arm: str, stock: str, share: float) -> None:
    floor, moved = largest_move(ring[stock], full[stock]), largest_move(ring[arm], full[arm])
    scale = float(np.abs(full[arm]).max())
    print(f"{arm}: one window against every row {moved:.3g}; stock's {floor:.3g}; scale {scale:.3g}")
    assert moved <= max(4 * floor, share * scale), (arm, moved, floor, scale)


def ring_and_full(model, maps, base: dict, tmp_path) -> tuple[dict, dict, dict, dict]:
    """Stock's and the arm's last 40 prompt rows ("stock_rows", "rows") and decode step ("stock", "decode"), over a
    one-window cache and over one that keeps every row: (ring, ring stats, full, full stats)."""
    runs = [{"name": "stock_rows", "rows": 40, "stock": True}, {"name": "stock", "stock": True},
            {"name": "rows", "rows": 40, "params": base}, {"name": "decode", "params": base}]
    ring, st = run_engine(model, maps, runs, session={**ONE_WINDOW, **RING_F32}, prompt=RING_PROMPT,
                          n_ctx=RING_CTX, tmp_path=tmp_path)
    full, st_full = run_engine(model, maps, runs, session={**FULL, **RING_F32}, prompt=RING_PROMPT, n_ctx=RING_CTX,
                               tmp_path=tmp_path)
    return ring, st, full, st_full


@pytest.mark.parametrize("params", [{}, {"exact_rows": RING_ROWS}, {"probe": [16, 8]}, {"fill": "plumb"}],
                         ids=["plain", "exact-rows", "probe", "plumb"])
def test_a_one_window_cache_moves_ridgefills_logits_about_as_much_as_stocks_against_a_cache_that_keeps_every_row(
        params, gemma3, tmp_path):
    # the tail's rows from the prefill and the stock decode step after it (a chunk one row longer fails exact-rows)
    require_builds("ridgefill")
    model, maps = gemma3
    ring, st, full, st_full = ring_and_full(model, maps, {"fill": "ridge", "tail": 40, "min_prefix": 0, **params},
                                            tmp_path)
    assert len(ring["tokens"]) > 2 * 256
    for name, stock in (("rows", "stock_rows"), ("decode", "stock")):
        assert st[name]["applied"] == 1, st[name]
        for key in ("n_filled", "n_exact", "n_probe_exact"):
            assert st[name][key] == st_full[name][key], (name, key)
        assert_moves_about_as_much_as_stock(ring, full, name, stock, share=2e-6)
    if "probe" not in params:  # (the probe's pass and the second sweep count their skips differently)
        assert st["decode"]["n_fill_skipped"] == st_full["decode"]["n_fill_skipped"]


def test_over_a_one_window_cache_probe_rows_reaching_into_the_prefix_see_every_filled_row_they_reach(gemma3,
                                                                                                      tmp_path):
    # 64 probe rows over a 40-row tail, and a listed row among them: the probe's rows reach filled rows that the
    # known rows' chunks passed without reaching. (Where the probe's rows reach into the prefix the two caches'
    # logits differed in their last bits on AVX-512 too, with or without that listed row, and before patch 0085.)
    require_builds("ridgefill")
    model, maps = gemma3
    tokenized, _ = run_engine(model, maps, [], session=ONE_WINDOW, prompt=RING_PROMPT, n_ctx=RING_CTX,
                              tmp_path=tmp_path)  # (no runs: the prompt's tokens only)
    n = len(tokenized["tokens"])
    base = {"fill": "ridge", "tail": 40, "min_prefix": 0, "probe": [64, 8], "exact_rows": [n - 50]}
    ring, st, full, st_full = ring_and_full(model, maps, base, tmp_path)
    for name, stock_name in (("rows", "stock_rows"), ("decode", "stock")):
        assert st[name]["applied"] == 1 and st[name]["n_probe_exact"] == st_full[name]["n_probe_exact"] == 8
        assert st[name]["n_exact"] == st_full[name]["n_exact"]
        assert_moves_about_as_much_as_stock(ring, full, name, stock_name, share=1e-5)


def test_a_one_window_cache_unified_over_several_sequences_is_refused_by_name(gemma3, tmp_path):
    # another sequence's batch between two steps could take a ring cell that a later chunk still reads
    require_builds("ridgefill")
    model, maps = gemma3
    runs = [{"name": "ridge", "params": {"fill": "ridge", "tail": 40, "min_prefix": 0}}]
    _, st = run_engine(model, maps, runs, session={**ONE_WINDOW, "n_seq_max": 2, "kv_unified": True},
                       prompt=RING_PROMPT, n_ctx=RING_CTX, tmp_path=tmp_path)
    assert st["ridge"]["applied"] == 0 and "unified over 2 sequences" in st["ridge"]["reason"]


def test_with_flash_attention_a_one_window_cache_moves_ridgefills_logits_as_little_as_stocks(gemma3, tmp_path):
    # CPU flash attention rounds differently when the cells come in another order: stock's own logits move too
    require_builds("ridgefill")
    model, maps = gemma3
    base = {"fill": "ridge", "tail": 40, "min_prefix": 0, "chunk": 48}
    runs = [{"name": "stock", "stock": True}, {"name": "ridge", "params": base},
            {"name": "probe", "params": {**base, "probe": [16, 8]}}]
    out = {}
    for name, cache in (("ring", ONE_WINDOW), ("full", FULL)):
        out[name], _ = run_engine(model, maps, runs, session={"flash_attn": True, **cache}, prompt=RING_PROMPT,
                                  n_ctx=RING_CTX, tmp_path=tmp_path)
    floor = kl(out["full"]["stock"], out["ring"]["stock"])
    for name in ("ridge", "probe"):
        moved = kl(out["full"][name], out["ring"][name])
        print(f"{name}: KL {moved:.2e} against stock's {floor:.2e}")
        assert out["ring"][name].argmax() == out["full"][name].argmax() and moved < 10 * max(floor, 1e-10), name


@pytest.mark.parametrize("params", [{"rescale": [16, True, False]}, {"fill": "oracle"}], ids=["rescale", "oracle"])
def test_a_one_window_cache_refuses_by_name_what_runs_every_exact_row_layer_by_layer_and_serves_stock(
        params, gemma3, tmp_path):
    require_builds("ridgefill")
    model, maps = gemma3
    runs = [{"name": "stock", "stock": True},
            {"name": "arm", "params": {"fill": "ridge", "tail": 40, "min_prefix": 0, **params}}]
    arrays, st = run_engine(model, maps, runs, session=ONE_WINDOW, prompt=RING_PROMPT, n_ctx=RING_CTX,
                            tmp_path=tmp_path)
    assert st["arm"]["applied"] == 0
    assert_same_bytes(arrays["arm"], arrays["stock"])
    assert "layer by layer, which a one-window cache cannot hold" in st["arm"]["reason"]
    assert "--swa-full" in st["arm"]["reason"]


@pytest.mark.parametrize("flash_attn", [False, True])
def test_plumb_oracle_and_nothing_filled_reproduce_stock_on_a_sliding_window_model(flash_attn, gemma3, tmp_path):
    # an exact row of a windowed layer that saw a cell beyond its window, or a global one that missed a cell, moves
    # these logits (the prompt is seven windows long)
    require_builds("ridgefill")
    model, maps = gemma3
    runs = [{"name": "stock", "stock": True},
            {"name": "plumb", "params": {"fill": "plumb", "tail": 40, "min_prefix": 0}},
            {"name": "oracle", "params": {"fill": "oracle", "tail": 40, "min_prefix": 0}},
            {"name": "nothing_filled", "params": {"fill": "ridge", "tail": 100000, "min_prefix": 0}},
            {"name": "ridge", "params": {"fill": "ridge", "tail": 40, "min_prefix": 0}}]
    arrays, stats = run_engine(model, maps, runs, session={"flash_attn": flash_attn, **FULL}, tmp_path=tmp_path)
    stock = arrays["stock"]
    assert len(arrays["tokens"]) > 7 * 32
    for name in ("plumb", "oracle", "nothing_filled"):
        assert stats[name]["applied"] == 1, stats[name]
        assert arrays[name].argmax() == stock.argmax(), name
        assert kl(stock, arrays[name]) < 1e-6, (name, kl(stock, arrays[name]))
    if not flash_attn:  # the same kernels over the same cells
        assert_same_bytes(arrays["plumb"], stock)
    assert stats["oracle"]["n_filled"] == stats["ridge"]["n_filled"] > 150
    assert kl(stock, arrays["ridge"]) > 1e-6


def test_resident_and_streamed_maps_give_byte_identical_logits_on_a_sliding_window_model(gemma3, tmp_path):
    require_builds("ridgefill")
    model, maps = gemma3
    runs = [{"name": "ridge", "params": {"fill": "ridge", "tail": 40, "chunk": 64, "min_prefix": 0}},
            {"name": "probe", "params": {"fill": "ridge", "tail": 40, "min_prefix": 0, "probe": [16, 8]}}]
    resident, _ = run_engine(model, maps, runs, session=FULL, tmp_path=tmp_path)
    streamed, _ = run_engine(model, maps, runs, session={"placement": "streamed", **FULL}, tmp_path=tmp_path)
    for name in ("ridge", "probe"):
        assert_same_bytes(resident[name], streamed[name], name)


def test_the_probe_ranks_rows_by_the_global_layers_and_keeps_them_exact(gemma3, tmp_path):
    require_builds("ridgefill")
    model, maps = gemma3
    runs = [{"name": "ridge", "params": {"fill": "ridge", "tail": 40, "min_prefix": 0}},
            {"name": "probe", "params": {"fill": "ridge", "tail": 40, "min_prefix": 0, "probe": [16, 8]}}]
    arrays, stats = run_engine(model, maps, runs, session=FULL, tmp_path=tmp_path)
    st = stats["probe"]
    assert st["applied"] == 1 and st["n_probe"] == 16 and st["n_probe_exact"] == 8
    assert st["n_filled"] == stats["ridge"]["n_filled"] - 8
    assert_bytes_differ(arrays["probe"], arrays["ridge"])


def test_a_windowed_layer_the_selectors_would_score_stands_for_the_nearest_global_layer_below_the_split(gemma3,
                                                                                                      tmp_path):
    # At split 4, layers 0, 1 and 3 are windowed and 2 is global. A windowed layer's cells are not the scored
    # cache's, so each listed one is scored as layer 2, the nearest below or above it. The default layers
    # (3, 7, 11, 15) leave layer 3 alone below the split, so the budget counts 20% of the prefix by layer 2.
    require_builds("ridgefill")
    model, _ = gemma3
    shape = tiny_shape("gemma3")
    src = write_float_file(tmp_path / "split4.safetensors", 4, [5], shape.n_embd, dtype="f32", seed=5)
    maps = convert(src, tmp_path / "split4.maps.gguf", model=model, outtype="f32").out
    n_query, share, tail = 24, 0.1, 40
    base = {"fill": "ridge", "tail": tail, "chunk": 48, "min_prefix": 0, "exact_rows": []}
    listed = {"global": [2], "below": [3], "above": [0], "several": [0, 1, 3]}
    runs = [{"name": name, "params": {**base, "attention": [n_query, share, layers]}} for name, layers in listed.items()]
    runs.append({"name": "budget", "params": {**base, "probe_budget": [16, 1.0]}})
    arrays, stats = run_engine(model, maps, runs, session={**TIGHT, **FULL}, tmp_path=tmp_path)
    prompt = arrays["tokens"].tolist()[:-1]  # the last token follows through llama_decode
    prefix = len(prompt) + 1 - tail
    ref, _ = reference_and_maps(model, maps)
    score = ref.attention_scores(prompt, [2], n_query)
    chosen = sorted(sorted(range(1, prefix), key=lambda r: -score[r])[:int(share * prefix + 0.5)])
    assert stats["global"]["exact_rows"] == [0] + chosen
    for name in ("below", "above", "several"):
        assert stats[name]["exact_rows"] == stats["global"]["exact_rows"], name
        assert_same_bytes(arrays[name], arrays["global"], f"windowed layers {listed[name]} against global layer 2")
    assert stats["budget"]["n_budget_attention"] == int(0.2 * prefix + 0.5) > 0, stats["budget"]
    # over llama-server's one-window cache too (the scores index the global cache's cells)
    ring, ring_stats = run_engine(model, maps, runs[:2], session={**TIGHT, **ONE_WINDOW}, prompt=RING_PROMPT,
                                  n_ctx=RING_CTX, tmp_path=tmp_path)
    assert len(ring_stats["below"]["exact_rows"]) > 1
    assert ring_stats["below"]["exact_rows"] == ring_stats["global"]["exact_rows"]
    assert_same_bytes(ring["below"], ring["global"], "one window: windowed layer 3 against global layer 2")


def test_below_a_split_with_no_global_layer_under_it_the_selectors_score_no_layer(gemma3, tmp_path):
    # at split 2 both layers below are windowed: nothing is scored, over either cache
    require_builds("ridgefill")
    model, maps = gemma3
    base = {"fill": "ridge", "tail": 40, "chunk": 48, "min_prefix": 0, "exact_rows": []}
    runs = [{"name": "attention", "params": {**base, "attention": [24, 0.1, [0, 1]]}},
            {"name": "budget", "params": {**base, "probe_budget": [16, 1.0]}}]
    for session in (FULL, ONE_WINDOW):
        _, stats = run_engine(model, maps, runs, session=session, prompt=RING_PROMPT, n_ctx=RING_CTX,
                              tmp_path=tmp_path)
        assert stats["attention"]["applied"] == 1 and stats["attention"]["exact_rows"] == [0], session
        assert stats["budget"]["applied"] == 1 and stats["budget"]["n_budget_attention"] == 0, session


@pytest.mark.parametrize("params", [{}, {"exact_rows": [40, 41, 120]}, {"probe": [16, 8]}],
                         ids=["plain", "exact-rows", "probe"])
def test_a_windowed_layer_skips_the_rows_no_reader_reaches_and_every_logit_stays_the_same(params, gemma3, tmp_path):
    # the prefill's logits for every tail row and the stock decode step after it, with the fill of windowed layers
    # skipped where no exact row, tail row or decode step is within the window, against every row filled; a row the
    # window reaches but the fill skipped changes them
    require_builds("ridgefill")
    model, maps = gemma3
    base = {"fill": "ridge", "tail": 40, "min_prefix": 0, "chunk": 48, **params}
    runs = [{"name": "rows", "rows": 40, "params": base}, {"name": "decode", "params": base}]
    skipped, st = run_engine(model, maps, runs, session=FULL, tmp_path=tmp_path)
    every, st_every = run_engine(model, maps, runs, session=FULL, tmp_path=tmp_path,
                                 env={"LLAMA_RIDGEFILL_FULL_WINDOW_FILL": "1"})
    for name in ("rows", "decode"):
        assert_same_bytes(skipped[name], every[name], name)
    assert st_every["decode"]["n_fill_skipped"] == 0
    n_filled = st["decode"]["n_filled"]
    if not params:  # the tail's first row reaches the 31 rows before it; the two windowed late layers skip the rest
        assert n_filled > 150 and st["decode"]["n_fill_skipped"] == 2 * (n_filled - 31)
    else:
        assert 0 < st["decode"]["n_fill_skipped"] < 2 * (n_filled - 31)


def test_the_ridge_arm_on_a_sliding_window_model_matches_an_independent_numpy_computation(gemma3, tmp_path):
    # the reference's windowed layers see the n_swa positions up to their own, from every filled row's prediction
    require_builds("ridgefill")
    from test_engine_prefill import reference_arms
    model, maps = gemma3
    tail, exact_rows = 40, [10, 57, 130]
    runs = [{"name": "ridge", "params": {"fill": "ridge", "tail": tail, "chunk": 48, "min_prefix": 0,
                                         "exact_rows": []}},
            {"name": "identity", "params": {"fill": "identity", "tail": tail, "min_prefix": 0}},
            {"name": "ridge_rows", "params": {"fill": "ridge", "tail": tail, "min_prefix": 0,
                                              "exact_rows": exact_rows}}]
    arrays, stats = run_engine(model, maps, runs, session={**TIGHT, **FULL}, tmp_path=tmp_path)
    want = reference_arms(model, maps, arrays["tokens"].tolist(), SPLIT, tail, exact_rows)
    for name, expected in want.items():
        rel = np.abs(arrays[name] - expected).max() / np.abs(expected).max()
        print(f"gemma3 {name}: rel {rel:.2e}, {stats[name]['n_fill_skipped']} fills skipped")
        assert stats[name]["applied"] == 1 and stats[name]["n_fill_skipped"] > 0, stats[name]
        assert rel < 5e-4, (name, rel)  # the GELU table's steps, as in tests/test_reference.py
    assert stats["ridge_rows"]["n_exact"] == stats["ridge"]["n_exact"] + 3
    assert np.abs(arrays["ridge"] - arrays["identity"]).max() > 1e-2


def test_llama_server_serves_a_sliding_window_model_over_its_default_one_window_cache_as_over_swa_full(
        gemma3, tmp_path):
    # llama-server keeps one window of the windowed layers' cache unless told otherwise (256 cells here, for a
    # 540-token prompt); ridgefill_gguf's Server (serve, bench, the demo) asks for --swa-full where maps meet windows
    from ridgefill_gguf.serve import Server
    from test_server import PROMPT

    require_builds("ridgefill")
    model, maps = gemma3
    small_batches = ("-b", "64", "-ub", "32", "-fa", "off")
    out = {}
    for name, swa_full in (("full", None), ("window", False)):
        with Server(model, maps, tail=64, min_prefix=0, threads=2, swa_full=swa_full, extra=small_batches,
                    log_path=tmp_path / f"{name}.log") as srv:
            out[name + "_probe"] = srv.complete(PROMPT, n_predict=3)  # the default selector: the probe
            out[name] = srv.complete(PROMPT, n_predict=3, ridgefill_select="none")
            out[name + "_off"] = srv.complete(PROMPT, n_predict=3, ridgefill=False)
            out[name + "_command"] = srv.command
    assert "--swa-full" in out["full_command"] and "--swa-full" not in out["window_command"]
    assert "llama_kv_cache_iswa: using full-size SWA cache" not in (tmp_path / "window.log").read_text()
    rf, rf_full = out["window"]["timings"]["ridgefill"], out["full"]["timings"]["ridgefill"]
    assert rf["split"] == SPLIT and rf["filled"] > 300 and rf["fill_skipped"] == rf_full["fill_skipped"] > 0
    assert out["window"]["content"] == out["full"]["content"] and out["window"]["tokens_predicted"] == 3
    assert "ridgefill" not in out["window_off"]["timings"] and out["window_off"]["tokens_predicted"] == 3
    # the probe's 256 rows and their window of 32 do not fit 256 cells: stock, and the request says why
    assert out["full_probe"]["timings"]["ridgefill"]["exact"] > 0
    why = out["window_probe"]["timings"]["ridgefill"]["not_used"]
    assert "the probe's 256 rows and their window do not fit the windowed cache's 256 cells" in why
    assert "--swa-full" in why and out["window_probe"]["content"] == out["window_off"]["content"]


def test_llama_server_and_the_eval_instruments_default_to_budget_2_on_a_sliding_window_model(gemma3, tmp_path):
    # the probe ranks with the global layers alone there: budget 1.5 lost 2 points on Gemma-3-270M's facts, 2 held
    from ridgefill_gguf.cli import _model_budget_default
    from ridgefill_gguf.serve import Server
    from test_server import PROMPT

    require_builds("ridgefill")
    model, maps = gemma3
    with Server(model, maps, tail=64, min_prefix=0, threads=2, extra=("-fa", "off"),
                log_path=tmp_path / "budget.log") as srv:
        props = srv.get("/props")["ridgefill"]
        # below split 2 no layer is scored, so without digits the base rules would count no rows
        prompt = "In 2024, 42 of 97 said so. " + PROMPT
        default = srv.complete(prompt, n_predict=1)["timings"]["ridgefill"]
        at_2 = srv.complete(prompt, n_predict=1, ridgefill_budget=2)["timings"]["ridgefill"]
        at_1_5 = srv.complete(prompt, n_predict=1, ridgefill_budget=1.5)["timings"]["ridgefill"]
    assert props["budget"] == 2 and default["select"] == "probe"
    assert default["budget"] == at_2["budget"] > at_1_5["budget"] > 0
    assert default["selected"] == at_2["selected"]
    assert _model_budget_default(model) == 2.0


@pytest.fixture(scope="module")
def gemma3_270m(tmp_path_factory):
    """Gemma-3-270M (18 layers, window 512, a global layer every sixth) and synthetic F32 maps at split 9: plumb,
    the oracle and the comparisons below do not depend on the maps' values."""
    from ridgefill_gguf import models
    from ridgefill_gguf.random_gguf import ModelShape

    path = models.model_path("gemma3-270m")
    if not path.exists():
        pytest.skip(f"{path.name} not fetched: `make models` (`make test` fetches it)")
    shape = ModelShape.from_gguf(path)
    d = tmp_path_factory.mktemp("gemma3-270m")
    src = write_float_file(d / "maps.safetensors", 9, list(range(10, shape.n_layer)), shape.n_embd, dtype="f32",
                           seed=4)
    return path, convert(src, d / "maps.gguf", model=path, outtype="f32").out


# a document of about 1,300 Gemma tokens: more than two windows of 512
LONG = ("The river rose through the night, and by morning the lower fields of the valley were under water. "
        "Farmers moved their animals to the ridge, counted what was left, and waited for the rain to stop. ") * 34


def test_ridgefill_off_with_maps_attached_is_byte_identical_to_upstream_on_gemma_3_270m(gemma3_270m):
    from ridgefill_gguf import equivalence as eq

    require_builds()
    model, maps = gemma3_270m
    report = eq.check(model, [LONG, "short prompt"], n_ctx=2048, decode_steps=3, maps=maps,
                      cases=[eq.Case(512, 512, False), eq.Case(256, 64, True)])
    bad = [r["key"] for r in report["arrays"] if not r["identical"]]
    assert report["n_logits"] > 100_000 and not bad, f"arrays differ: {bad}"


def test_plumb_and_the_oracle_reproduce_stock_and_streamed_maps_the_resident_bytes_on_gemma_3_270m(
        gemma3_270m, tmp_path):
    require_builds("ridgefill")
    model, maps = gemma3_270m
    base = {"tail": 256, "min_prefix": 0}
    runs = [{"name": "stock", "stock": True},
            {"name": "plumb", "params": {"fill": "plumb", **base}},
            {"name": "oracle", "params": {"fill": "oracle", **base}},
            {"name": "ridge", "params": {"fill": "ridge", **base}}]
    arrays, stats = run_engine(model, maps, runs, prompt=LONG, n_ctx=2048, session=FULL, tmp_path=tmp_path)
    assert len(arrays["tokens"]) > 2 * 512 + 256
    for name in ("plumb", "oracle"):
        assert stats[name]["applied"] == 1 and arrays[name].argmax() == arrays["stock"].argmax(), name
        assert kl(arrays["stock"], arrays[name]) < 1e-6, (name, kl(arrays["stock"], arrays[name]))
    assert stats["ridge"]["n_fill_skipped"] > 0 and kl(arrays["stock"], arrays["ridge"]) > 1e-6
    streamed, _ = run_engine(model, maps, runs[-1:], prompt=LONG, n_ctx=2048,
                             session={"placement": "streamed", **FULL}, tmp_path=tmp_path)
    assert_same_bytes(streamed["ridge"], arrays["ridge"])


def test_with_flash_attention_plumb_moves_gemma_3_270m_less_than_stock_moves_between_two_ubatch_sizes(
        gemma3_270m, tmp_path):
    # With flash attention this model's own logits move with the ubatch: on the CPU a batch of fewer than 64 rows
    # accumulates V in F16, a larger one in the tiled F32 kernel. The floor is stock against stock at another ubatch
    require_builds("ridgefill")
    model, maps = gemma3_270m
    fa = {"flash_attn": True, **FULL}
    runs = [{"name": "stock", "stock": True}, {"name": "plumb", "params": {"fill": "plumb", "tail": 256,
                                                                            "min_prefix": 0}}]
    arrays, stats = run_engine(model, maps, runs, prompt=LONG, n_ctx=2048, session=fa, tmp_path=tmp_path)
    other, _ = run_engine(model, maps, runs[:1], prompt=LONG, n_ctx=2048,
                          session={**fa, "n_batch": 512, "n_ubatch": 512}, tmp_path=tmp_path)
    floor, moved = kl(arrays["stock"], other["stock"]), kl(arrays["stock"], arrays["plumb"])
    print(f"plumb against stock with flash attention: KL {moved:.3g}; stock at ubatch 32 against 512: {floor:.3g}")
    # (on an AVX2 CPU the two ubatches' own top tokens differ: this prompt's first two are close)
    assert stats["plumb"]["applied"] == 1 and arrays["plumb"].argmax() in {arrays["stock"].argmax(),
                                                                          other["stock"].argmax()}
    assert floor > 1e-3 and moved <= floor, (moved, floor)


@pytest.mark.parametrize("flash_attn", [False, True])
def test_masks_made_in_the_graphs_with_the_window_give_the_bytes_of_llama_cpps_host_made_masks(flash_attn, gemma3,
                                                                                              tmp_path):
    # the exact rows' masks of a windowed layer: a cell the window has left is masked as llama.cpp masks it
    require_builds("ridgefill")
    model, maps = gemma3
    arms = (("ridge", {}), ("rows", {"exact_rows": [40, 41, 120]}), ("probe", {"probe": [16, 8]}))
    runs = [{"name": name, "params": {"fill": "ridge", "tail": 40, "chunk": 48, "min_prefix": 0, **extra}}
            for name, extra in arms]
    session = {"flash_attn": flash_attn, "n_ubatch": 16, **FULL}
    device, st = run_engine(model, maps, runs, session=session, tmp_path=tmp_path)
    host, st_host = run_engine(model, maps, runs, session=session, tmp_path=tmp_path,
                               env={"LLAMA_RIDGEFILL_HOST_MASK": "1"})
    for name, _ in arms:
        assert st[name]["applied"] == 1 and st[name]["exact_rows"] == st_host[name]["exact_rows"]
        assert (st[name]["device_mask"], st_host[name]["device_mask"]) == (1, 0), "each path ran"
        assert_same_bytes(device[name], host[name], name)


def test_a_one_window_cache_restores_checkpoints_of_approximated_cells_only_for_requests_that_may_reuse_them(
        gemma3, tmp_path):
    # over one window the server cannot roll the windowed cells back: a conversation that leaves the cached one
    # before the ring's oldest cell restores a context checkpoint, and the one a RidgeFill prefill wrote holds
    # late-layer cells written from the fill
    from ridgefill_gguf.serve import Server
    from test_server import PROMPT, STOCK_NOISE, metric, top_logprob_gap

    require_builds("ridgefill")
    model, maps = gemma3
    later = PROMPT + "Then the story turned to rivers, mountains and the long roads between them. " * 30
    other = PROMPT + "Then the story turned to deserts instead. " * 20  # leaves `later` before its ring's cells
    ask = dict(n_predict=4, n_probs=5, cache_prompt=True)
    extra = ("-b", "64", "-ub", "32", "-fa", "off", "--metrics", "--ridgefill-select", "none", "--ridgefill-reuse", "any")
    with Server(model, maps, tail=64, min_prefix=0, threads=2, swa_full=False, extra=extra,
                log_path=tmp_path / "checkpoints.log") as srv:
        fresh = srv.complete(other, n_predict=4, n_probs=5, ridgefill=False)
        out = {}
        for name, ridgefill in (("follow_up", None), ("stock", False)):
            assert srv.complete(PROMPT, n_predict=4)["timings"]["ridgefill"]["filled"] > 300
            srv.complete(later, **ask)
            out[name] = srv.complete(other, ridgefill=ridgefill, **ask)
            out[name + "_restored"] = metric(srv, "ridgefill_approx_checkpoints_total")
    follow_up, stock = out["follow_up"]["timings"], out["stock"]["timings"]
    assert follow_up["cache_n"] > 500 and follow_up["ridgefill"]["approx_checkpoints"] == 1, follow_up
    assert out["follow_up_restored"] == out["stock_restored"] == 1
    assert top_logprob_gap(out["follow_up"], fresh) > 10 * STOCK_NOISE
    # the stock request restores none of them: it prefills the conversation again and gets the stock numbers
    assert stock["cache_n"] == 0 and "ridgefill" not in stock, stock
    assert top_logprob_gap(out["stock"], fresh) < STOCK_NOISE
