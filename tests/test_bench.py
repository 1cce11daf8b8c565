"""The time-to-first-token benchmark: its ceilings, and a run end to end on a tiny model."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, require_builds
from ridgefill_gguf.bench import against_upstream, layer_ceiling, mac_ceiling, run_bench
from ridgefill_gguf.eval.arms import SERVER_BUDGET
from ridgefill_gguf.random_gguf import ModelShape
from ridgefill_gguf.maps.synthetic import write_random_maps
from ridgefill_gguf.random_gguf import tiny_shape, write_random_model


def test_the_layer_ceiling_matches_the_papers_flash_next_numbers():
    # paper §2.5: L=48, S=24, T=2048 gives 1.64x at 9K and 1.88x at 32K
    assert layer_ceiling(9216, 24, 2048, 48) == pytest.approx(1.64, abs=0.005)
    assert layer_ceiling(32768, 24, 2048, 48) == pytest.approx(1.88, abs=0.005)
    assert layer_ceiling(1000, 24, 2048, 48) == 1.0


def test_the_mac_ceiling_is_one_when_nothing_is_filled_and_grows_with_the_filled_share():
    shape = ModelShape("qwen3", 36, 4096, 12288, 32, 8, 128)
    assert mac_ceiling(shape, 16384, 13, 0, 16384) == pytest.approx(1.0)
    low = mac_ceiling(shape, 16384, 13, 8192, 8192)
    high = mac_ceiling(shape, 16384, 13, 12288, 4096)
    assert 1.0 < low < high < layer_ceiling(16384, 13, 4096, 36) + 1e-9


def test_the_mac_ceiling_counts_each_exact_rows_attention_at_its_own_position():
    # an independent count, row by row: a row at position p reads p + 1 cells in every layer it runs exactly
    shape = ModelShape("qwen3", 6, 64, 192, 4, 2, 16)
    n, split, tail, chosen = 300, 2, 40, [0, 17, 150]
    q, kv = shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    per_row = shape.n_embd * (q + 2 * kv) + q * shape.n_embd + 3 * shape.n_embd * shape.n_ff
    layer_row = lambda p: per_row + 2 * q * (p + 1)
    exact = sum(shape.n_layer * layer_row(p) for p in range(n))
    late = shape.n_layer - split
    filled = [p for p in range(n - tail) if p not in chosen]
    rf = (sum(split * layer_row(p) for p in range(n))
          + len(filled) * ((late - 1) * shape.n_embd ** 2 + late * shape.n_embd * 2 * kv)
          + sum(late * layer_row(p) for p in [*range(n - tail, n)]))
    # the stats give no positions for chosen prefix rows: they are counted at the average length
    rf += len(chosen) * late * (per_row + 2 * q * (n + 1) / 2)
    got = mac_ceiling(shape, n, split, len(filled), len(chosen) + tail, tail=tail)
    assert got == pytest.approx(exact / rf, rel=1e-12)
    # the tail reads more than the average row: counting it at the average would overstate the ceiling
    assert got < mac_ceiling(shape, n, split, len(filled), len(chosen) + tail)


def test_the_mac_ceiling_of_a_sliding_window_model_counts_each_window_and_the_fills_no_reader_reaches():
    # row by row again: in a windowed layer a row at position p reads min(p + 1, W) cells, and a windowed late
    # layer writes only the filled rows within the window before the tail (plain ridge: no chosen rows)
    shape = ModelShape("gemma3", 6, 64, 192, 4, 2, 16, n_swa=32, swa_pattern=3)
    n, split, tail, w = 300, 2, 40, 32
    q, kv = shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    per_row = shape.n_embd * (q + 2 * kv) + q * shape.n_embd + 3 * shape.n_embd * shape.n_ff
    windowed = [shape.is_swa(il) for il in range(shape.n_layer)]
    assert windowed == [True, True, False, True, True, False]
    cost = lambda il, p: per_row + 2 * q * (min(p + 1, w) if windowed[il] else p + 1)
    exact = sum(cost(il, p) for il in range(shape.n_layer) for p in range(n))
    filled = list(range(1, n - tail))  # row 0 runs exactly
    reached = [p for p in filled if p > n - tail - w]
    # row 0, a chosen exact row, is counted at the average length: the stats give no positions
    average = lambda il: sum(min(p + 1, w) if windowed[il] else p + 1 for p in range(n)) / n
    rf = sum(cost(il, p) for il in range(split) for p in range(n))
    for il in range(split, shape.n_layer):
        rows = reached if windowed[il] else filled
        rf += len(rows) * ((shape.n_embd ** 2 if il > split else 0) + shape.n_embd * 2 * kv)
        rf += sum(cost(il, p) for p in range(n - tail, n)) + per_row + 2 * q * average(il)
    skipped = 2 * (len(filled) - len(reached))
    got = mac_ceiling(shape, n, split, len(filled), 1 + tail, tail=tail, n_fill_skipped=skipped)
    assert got == pytest.approx(exact / rf, rel=1e-12)
    # the windows make the stock prefill cheaper, the skipped fills RidgeFill's
    dense = ModelShape("gemma3", 6, 64, 192, 4, 2, 16)
    assert mac_ceiling(shape, n, split, len(filled), 1 + tail, tail=tail) < got
    assert got != mac_ceiling(dense, n, split, len(filled), 1 + tail, tail=tail)


def test_the_fill_variants_drop_the_maps_and_then_the_kv_projections_from_the_count():
    shape = ModelShape("qwen3", 36, 4096, 12288, 32, 8, 128)
    ridge, identity, none = (mac_ceiling(shape, 32768, 13, 28671, 4097, tail=4096, fill=f)
                             for f in ("ridge", "identity", "none"))
    assert 1.0 < ridge < identity < none


def test_a_bench_placement_with_a_fill_variant_starts_its_server_with_that_fill(tmp_path):
    require_builds("ridgefill")
    from ridgefill_gguf.bench import split_placement

    assert split_placement("resident") == ("resident", "ridge")
    assert split_placement("streamed:identity") == ("streamed", "identity")
    with pytest.raises(ValueError, match="placement 'resident:magic'"):
        split_placement("resident:magic")
    model = write_random_model(tmp_path / "m.gguf", dataclasses.replace(tiny_shape("llama"), n_layer=4), seed=2)
    maps = write_random_maps(model, 1, tmp_path / "maps.gguf")
    r = run_bench(model, maps, [300], tail=64, repeats=1, threads=2, out_dir=tmp_path / "out", label="variants",
                  placements=("resident", "resident:none"), min_prefix=0, log=lambda s: None)
    assert "--ridgefill-fill none" in r["server_commands"]["resident:none"]
    assert "--ridgefill-fill ridge" in r["server_commands"]["resident"]
    plain, none = r["rows"]
    assert none["placement"] == "resident:none" and none["ceiling_macs"] > plain["ceiling_macs"]
    assert (tmp_path / "out" / "server-resident-none.log").exists()


def test_the_phase_table_splits_ridgefills_time_into_phases_that_add_up_and_ceiling_shares():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_phases", ROOT / "tools" / "bench_phases.py")
    phases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(phases)
    stem = ROOT / "results" / "bench" / "2026-12-01-qwen3-8b-q8_0-shape-h200-patch0018"
    r = json.loads(stem.with_suffix(".json").read_text())
    totals = phases.engine_totals(stem.with_suffix(".server.log"), r["repeats"])
    assert set(totals) == {16384, 32768, 65536}  # the warm-up's length keeps only its timed requests
    resident = [x for x in r["rows"] if x["placement"] == "resident"]
    for row, x in zip(phases.phase_rows(r, totals, "resident"), resident):
        num = lambda cell: float(cell.split(" ")[0].replace(",", ""))
        measured = sum(num(c) for c in row[2:7])  # three phases, the rest of the prefill, after it
        assert measured == pytest.approx(x["median_ridgefill_ms"], abs=3)  # rounded cells
        ideal = float(row[1].split("(")[1].rstrip(")").replace(",", ""))
        up = next(u["median_upstream_ms"] for u in r["off_vs_upstream"] if u["tokens"] == x["tokens"])
        assert ideal == pytest.approx(up / x["ceiling_macs"], abs=1)


def test_the_phase_table_takes_the_engines_totals_from_a_result_that_records_them():
    import subprocess
    import sys

    result = ROOT / "results" / "bench" / "2026-12-06-qwen35-27b-q8_0-shape-h100-session28-streamed-long.json"
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_phases.py"), str(result), "--placement",
                          "streamed"], capture_output=True, text=True, check=True).stdout
    r = json.loads(result.read_text())
    for x in r["rows"]:  # after the prefill: the server's prompt time less the engine's own
        after = x["median_ridgefill_ms"] - x["phases_ms"]["total_ms"]
        assert f"| {x['tokens']} | {x['median_ridgefill_ms']:,.0f} " in out and f"| {after:,.0f} | exact arm |" in out


def test_a_bench_run_writes_json_markdown_and_a_plot_and_records_the_engines_environment(tmp_path, monkeypatch):
    require_builds("ridgefill")
    model = write_random_model(tmp_path / "m.gguf", dataclasses.replace(tiny_shape("llama"), n_layer=4), seed=2)
    maps = write_random_maps(model, 1, tmp_path / "maps.gguf")
    monkeypatch.setenv("LLAMA_RIDGEFILL_HOST_MASK", "1")  # the servers inherit it: the result must say so
    r = run_bench(model, maps, [300, 600], tail=64, repeats=1, threads=2, out_dir=tmp_path / "out",
                  label="tiny", min_prefix=0, log=lambda s: None)
    data = json.loads((tmp_path / "out" / f"{r['date']}-tiny.json").read_text())
    assert data["partial"] is False and [x["tokens"] for x in data["rows"]] == [300, 600]
    row = data["rows"][0]
    assert row["rows"]["filled"] + row["rows"]["exact"] + row["rows"]["tail"] == 300
    assert row["speedup"] > 0 and row["ceiling_macs"] > 1
    # the engine's total is recorded and what its phases leave out is shown, never negative
    phases = row["phases_ms"]
    assert phases["total_ms"] >= phases["early_ms"] + phases["fill_ms"] + phases["exact_ms"] - 1e-6
    assert phases["other_ms"] >= -1e-6 and phases["wall_ms"] >= phases["total_ms"] - 1e-6
    assert data["build"]["patches"] >= 1 and len(data["build"]["patch_series_sha256"]) == 16
    assert data["build"]["servers"]["resident"]  # the server's own build_info
    assert data["environment"].get("LLAMA_RIDGEFILL_HOST_MASK") == "1"
    md = (tmp_path / "out" / f"{r['date']}-tiny.md").read_text()
    assert "| resident | 600 |" in md and "environment LLAMA_RIDGEFILL_HOST_MASK=1" in md
    assert (tmp_path / "out" / f"{r['date']}-tiny.png").stat().st_size > 1000


def test_the_bench_times_upstream_against_ridgefill_attached_but_off(tmp_path):
    require_builds("upstream", "ridgefill")
    model = write_random_model(tmp_path / "m.gguf", dataclasses.replace(tiny_shape("qwen3"), n_layer=4), seed=3)
    maps = write_random_maps(model, 1, tmp_path / "maps.gguf")
    r = run_bench(model, maps, [400], tail=64, repeats=2, threads=2, out_dir=tmp_path / "out", label="off",
                  min_prefix=0, vs_upstream=True, log=lambda s: None)
    (off,) = r["off_vs_upstream"]
    assert off["tokens"] == 400 and len(off["upstream_ms"]) == len(off["off_ms"]) == 2
    assert off["off_over_upstream"] > 0
    assert set(r["server_commands"]) == {"resident", "upstream", "attached_off"}
    assert "--ridgefill" in r["server_commands"]["attached_off"] and "--ridgefill" not in r["server_commands"]["upstream"]
    assert "| 400 |" in (tmp_path / "out" / f"{r['date']}-off.md").read_text().split("against the upstream build")[1]
    (vs,) = r["ridgefill_vs_upstream"]
    assert vs["median_upstream_ms"] == off["median_upstream_ms"] and vs["speedup"] > 0
    assert r["stock_warmup"]["resident"]["tokens"] == 400 and r["stock_warmup"]["resident"]["stock_ms"] > 0


@pytest.mark.parametrize("swa_full", [True, False], ids=["swa-full", "one-window"])
def test_the_bench_times_a_sliding_window_models_upstream_over_both_windowed_caches(swa_full, tmp_path):
    # every server of the run keeps the same windowed cache (by default every row: --swa-full), and upstream is
    # also timed with the other; over one window of cells (256 here, a 700-row prompt) RidgeFill reuses them
    require_builds("upstream", "ridgefill")
    model = write_random_model(tmp_path / "m.gguf", tiny_shape("gemma3"), seed=3)
    maps = write_random_maps(model, 2, tmp_path / "maps.gguf")
    r = run_bench(model, maps, [700], tail=64, repeats=1, threads=2, out_dir=tmp_path / "out", label="swa",
                  min_prefix=0, vs_upstream=True, swa_full=swa_full, extra=("-b", "64", "-ub", "32"),
                  log=lambda s: None)
    (off,) = r["off_vs_upstream"]
    other = "upstream_one_window" if swa_full else "upstream_swa_full"
    assert len(off[f"{other}_ms"]) == 1 and off[f"median_{other}_ms"] > 0 and r["swa_full"] == swa_full
    commands = r["server_commands"]
    for name in ("upstream", "resident", "attached_off"):
        assert ("--swa-full" in commands[name]) == swa_full, name
    assert ("--swa-full" in commands[other]) == (not swa_full) and "--ridgefill" not in commands[other]
    (row,) = r["rows"]
    assert row["rows"]["filled"] > 500 and row["speedup"] > 0
    assert "one window of cells" in (tmp_path / "out" / f"{r['date']}-swa.md").read_text()


def test_ridgefill_is_also_compared_with_upstreams_stock_prefill_of_the_same_length():
    rows = [{"placement": "resident", "tokens": n, "median_exact_ms": ex, "median_ridgefill_ms": rf, "ceiling_macs": c}
            for n, ex, rf, c in ((100, 110.0, 50.0, 2.5), (200, 220.0, 100.0, 2.5))]
    off = [{"tokens": 200, "median_upstream_ms": 200.0, "median_off_ms": 201.0}]
    (x,) = against_upstream(rows, off)  # only lengths upstream was timed at
    assert x["tokens"] == 200 and x["speedup"] == 2.0 and x["share_of_ceiling"] == 0.8
    assert x["exact_over_upstream"] == 1.1


def test_the_exact_row_line_is_fitted_by_least_squares():
    from ridgefill_gguf.bench import fit_line

    assert fit_line([(0, 10.0), (100, 30.0), (200, 50.0)]) == pytest.approx((10.0, 0.2))


def test_the_bench_times_selectors_and_the_exact_row_line_beside_plain_ridgefill(tmp_path):
    require_builds("ridgefill")
    model = write_random_model(tmp_path / "m.gguf", dataclasses.replace(tiny_shape("llama"), n_layer=4), seed=4)
    maps = write_random_maps(model, 1, tmp_path / "maps.gguf")
    r = run_bench(model, maps, [500], tail=64, repeats=1, threads=2, out_dir=tmp_path / "out", label="sel",
                  min_prefix=0, selectors=("probe@1", "random@1", "probe@2", "probe"), exact_shares=(0.25, 0.5),
                  log=lambda s: None)
    probe, rand, doubled, default = r["selectors"]
    assert probe["selector"] == "probe@1" and rand["selector"] == "random@1"
    # the tiny prompt's budget: its digit tokens (no table, no layer 3/7/11/15 below split 1); random matches it
    assert probe["budget"] == rand["budget"] == rand["selected"] > 0 and probe["prefix"] == 436
    # a budget factor per request: twice the rows the base rules count; a bare selector runs at the server's
    # default, which the bench reads from /props (the eval instruments' too on a model without sliding-window layers)
    assert doubled["budget_factor"] == 2.0 and probe["budget_factor"] == 1.0 and default["budget_factor"] == 1.5
    assert default["budget_factor"] == SERVER_BUDGET
    assert doubled["budget"] == 2 * probe["budget"] and probe["budget"] < default["budget"] < doubled["budget"]
    (line,) = r["exact_rows_line"]
    assert [p["exact_rows"] for p in line["points"]] == [0, 109, 218]
    assert line["tail_row_ms"] > 0 and line["kappa"] is not None
    md = (tmp_path / "out" / f"{r['date']}-sel.md").read_text()
    assert "| resident | 500 | probe |" in md and "| resident | 500 | 0: " in md


def test_the_sweep_one_control_times_the_first_layers_stock_against_sweep_one(tmp_path):
    require_builds("ridgefill")
    shape = dataclasses.replace(tiny_shape("qwen3"), n_layer=4)
    model = write_random_model(tmp_path / "m.gguf", shape, seed=0)
    first = write_random_model(tmp_path / "first2.gguf", dataclasses.replace(shape, n_layer=2), seed=0)
    maps = write_random_maps(model, 2, tmp_path / "maps.gguf")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_early_control.py"), str(model), str(maps),
                           str(first), "--tokens", "600", "--tail", "64", "--repeats", "1", "--min-prefix", "0",
                           "-t", "2", "--results", str(tmp_path / "out")], text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (result,) = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")]
    row = result["rows"]["600"]
    assert result["split"] == 2 and result["n_layer"] == 4
    assert row["sweep_one_ms"] > 0 and row["stock_first_layers_ms"] > 0 and row["stock_full_ms"] > 0
    # a model that is not the first S layers is refused
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_early_control.py"), str(model), str(maps),
                          str(model)], text=True, capture_output=True, timeout=600)
    assert bad.returncode != 0 and "must have the split's 2 layers" in bad.stderr


def test_the_stock_after_ridgefill_diagnostic_times_each_phase_with_the_gpus_clocks(tmp_path):
    require_builds("ridgefill")
    model = write_random_model(tmp_path / "m.gguf", dataclasses.replace(tiny_shape("qwen3"), n_layer=4), seed=0)
    maps = write_random_maps(model, 2, tmp_path / "maps.gguf")
    # a stand-in nvidia-smi: GPU 0's memory, SM clock, power and temperature every 20 ms, whatever it is asked
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nwhile true; do echo '0, 1000, 1980, 350.5, 60'; sleep 0.02; done\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_stock_after.py"), str(model), str(maps),
                           "--tokens", "600", "--small", "300", "--tail", "64", "--repeats", "1", "--idle", "0",
                           "--min-prefix", "0", "-t", "2", "--no-graphs", "--results", str(tmp_path / "out")],
                          text=True, capture_output=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (result,) = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")]
    assert set(result["variants"]) == {"default", "no-cuda-graphs"}
    v = result["variants"]["no-cuda-graphs"]
    assert v["environment"] == {"GGML_CUDA_DISABLE_GRAPHS": "1"}
    assert [(r["phase"], r["ridgefill"]) for r in v["requests"]] == [
        ("fresh", False), ("after-small", True), ("after-small", False), ("after-full", True), ("after-full", False),
        ("after-idle", False)]
    assert set(v["median_ms"]) == {"fresh", "after-small", "after-full", "after-idle"}
    assert all(r["clocks.sm"] == 1980 and r["power.draw"] == 350.5 for r in v["requests"])
    md = next((tmp_path / "out").glob("*.md")).read_text()
    assert "| no-cuda-graphs | after-idle | stock | 600 |" in md


def test_the_hybrid_mac_ceiling_charges_what_a_filled_row_still_does_in_a_deltanet_layer():
    from ridgefill_gguf.bench import layer_macs
    from ridgefill_gguf.random_gguf import REAL_SHAPES

    s = REAL_SHAPES["qwen35-27b"]
    m = layer_macs(s)
    # in-projections from d 5120 (q, k and v 2*16*128 + 48*128 = 10,240; beta and alpha 2*48), the 4-wide conv
    # over the 10,240 channels, and the recurrence over 48 states of 128 x 128; a filled row has no output, so no
    # output gate z (6,144) either
    assert m["deltanet_fill"] == 5120 * (10240 + 96) + 4 * 10240 + 4 * 48 * 128 * 128
    # a row with an output adds z, the output projection and the MLP
    assert m["deltanet"] == m["deltanet_fill"] + 2 * 6144 * 5120 + 3 * 5120 * 17408
    # the gated query doubles qwen35's query projection
    assert m["attention"] == 5120 * (2 * 24 * 256 + 2 * 4 * 256) + 24 * 256 * 5120 + 3 * 5120 * 17408
    n, split, tail = 32768, 16, 4096
    plain = mac_ceiling(s, n, split, n - tail - 1, tail + 1, tail=tail)
    probe = mac_ceiling(s, n, split, n - tail - 1, tail + 1, tail=tail, n_probe=256)
    print(f"27B hybrid at 32K, split 16, tail 4096: MAC ceiling {plain:.3f}x plain, {probe:.3f}x with a 256-row "
          f"probe; 1/r {layer_ceiling(n, split, tail, 64):.3f}x")
    assert 1.0 < probe < plain < layer_ceiling(n, split, tail, 64)
    # the same sizes with every layer attention, whose filled rows write only K/V: a higher ceiling
    skipped = dataclasses.replace(s, full_attention_interval=1)  # every layer attention
    assert mac_ceiling(skipped, n, split, n - tail - 1, tail + 1, tail=tail) > plain


def test_a_mixture_of_experts_counts_the_experts_a_row_uses_and_reads_them_from_the_gguf(tmp_path):
    from ridgefill_gguf.bench import layer_macs
    from ridgefill_gguf.random_gguf import REAL_SHAPES, tiny_shape, write_random_model

    s = REAL_SHAPES["qwen3next-80b-e64"]
    m = layer_macs(s)
    # 10 used experts and the shared one, 512 wide each; the router over 64 experts and the shared expert's gate
    ffn = 3 * 2048 * (10 * 512 + 512) + 2048 * 65
    # gated queries of 16 heads of 256, 2 KV heads
    assert m["attention"] == 2048 * (2 * 16 * 256 + 2 * 2 * 256) + 16 * 256 * 2048 + ffn
    assert m["deltanet"] == m["deltanet_fill"] + 2 * 32 * 128 * 2048 + ffn
    tiny = tiny_shape("qwen3next")
    read = ModelShape.from_gguf(write_random_model(tmp_path / "next.gguf", tiny, seed=1))
    assert (read.n_expert, read.n_expert_used, read.n_ff_exp, read.n_ff_shexp) == (4, 2, 32, 48)
    assert layer_macs(read) == layer_macs(tiny)


def test_the_state_update_ceiling_times_each_deltanet_row_the_same_in_both_arms():
    from ridgefill_gguf.bench import mac_counts, state_update_ceiling, state_update_rows
    from ridgefill_gguf.random_gguf import REAL_SHAPES

    s = REAL_SHAPES["qwen35-27b"]
    n, split, tail, exact_ms = 32768, 16, 4096, 12550.0
    args = (s, n, split, n - tail - 1, tail + 1)
    # every row crosses all 48 DeltaNet layers in both arms; the probe's rows cross the 36 late ones once more
    assert state_update_rows(s, n, split) == {"stock": 48 * n, "ridgefill": 48 * n}
    assert state_update_rows(s, n, split, n_probe=256)["ridgefill"] == 48 * n + 36 * 256
    # an independent count: the state's MACs leave both sums, its time joins both at us_per_row
    c, us = mac_counts(*args, tail=tail), 1.2385
    state = 4 * 48 * 128 * 128
    rate = (c["stock"] - 48 * n * state) / (exact_ms - 48 * n * us / 1000)
    rf_ms = (c["early"] + c["fill"] + c["exact"] - 48 * n * state) / rate + 48 * n * us / 1000
    got = state_update_ceiling(*args, exact_ms, us, tail=tail)
    assert got == pytest.approx(exact_ms / rf_ms, rel=1e-12)
    print(f"27B hybrid at 32K: MAC ceiling {mac_ceiling(*args, tail=tail):.3f}x, {got:.3f}x with the state update "
          f"at {us} us per row")
    # a state update that costs time RidgeFill cannot remove lowers the ceiling, the more the dearer it is
    assert 1.0 < state_update_ceiling(*args, exact_ms, 3.0, tail=tail) < got < mac_ceiling(*args, tail=tail)
    # a dense model has no state update: the ceiling is the MAC ceiling whatever the time per row
    dense = ModelShape("qwen3", 36, 4096, 12288, 32, 8, 128)
    assert state_update_ceiling(dense, n, 13, n - tail - 1, tail + 1, 4000.0, 5.0, tail=tail) == \
        pytest.approx(mac_ceiling(dense, n, 13, n - tail - 1, tail + 1, tail=tail), rel=1e-12)
    with pytest.raises(ValueError, match="state update alone"):
        state_update_ceiling(*args, 1000.0, us, tail=tail)


def test_a_results_state_update_ceilings_count_each_selectors_exact_rows_as_its_mac_ceiling_did():
    from ridgefill_gguf.bench import add_state_update_ceilings, markdown, state_update_ceiling

    r = json.loads((ROOT / "results/bench/2026-12-03-qwen35-27b-q8_0-shape-h200-patch0043.json").read_text())
    shape = ModelShape(**r["shape"])
    add_state_update_ceilings(r, 0.0)
    for x in r["rows"]:  # with a free state update, only the state's MACs leave the count
        assert x["ceiling_state"] == pytest.approx(x["ceiling_macs"], rel=0.01)
    for x in r["selectors"]:
        assert x["ceiling_state"] == pytest.approx(x["ceiling_macs"], rel=0.01)
        b = next(y for y in r["rows"] if y["tokens"] == x["tokens"])
        exact = x["selected"] + b["rows"]["exact"]
        assert x["ceiling_state"] == state_update_ceiling(shape, x["tokens"], r["split"], x["prefix"] - exact,
                                                          exact + b["rows"]["tail"], b["median_exact_ms"], 0.0,
                                                          tail=b["rows"]["tail"], n_probe=x["probe_rows"])
    assert "state update timed" in markdown(add_state_update_ceilings(r, 1.2385))
    assert all(x["ceiling_state"] < x["ceiling_macs"] for x in r["rows"] + r["selectors"])


def test_the_memory_bench_reads_llama_cpps_breakdown_rows_and_compute_growth():
    from ridgefill_gguf.bench_memory import compute_growth, parse_breakdown
    log = ("common_memory_breakdown_print: | memory breakdown [MiB] | total   free    self   model   context   compute"
           "    unaccounted |\n"
           "common_memory_breakdown_print: |   - CUDA0 (H200)       | 143771 = 110000 + (30617 =  9100 +   21000 +"
           "     517) +        3154 |\n"
           "common_memory_breakdown_print: |   - Host               |                  1210 =  1050 +       0 +"
           "     160                |\n"
           "W ~llama_context:      CUDA0 compute buffer size of 3328.6250 MiB, does not match expectation of "
           "224.2599 MiB\n")
    b = parse_breakdown(log)
    assert b["CUDA0"] == {"total": 143771, "free": 110000, "self": 30617, "model": 9100, "context": 21000,
                          "compute": 517, "unaccounted": 3154}
    assert b["Host"] == {"self": 1210, "model": 1050, "context": 0, "compute": 160}
    assert compute_growth(log) == {"CUDA0": {"held_mib": 3328.625, "reserved_mib": 224.2599}}
    # llama.cpp pads small sizes to their width (%8.4f)
    padded = "W ~llama_context:        CPU compute buffer size of  10.1719 MiB, does not match expectation of   5.3926 MiB"
    assert compute_growth(padded) == {"CPU": {"held_mib": 10.1719, "reserved_mib": 5.3926}}


def test_device_memory_reads_every_gpu_and_a_split_run_shows_each_gpus_peak_and_busy_share(tmp_path, monkeypatch):
    from ridgefill_gguf import bench

    # a stand-in nvidia-smi for two GPUs, one line each per cycle: GPU 0 holds 1000 MiB and reports no utilization,
    # GPU 1 goes from 500 MiB idle to 3000 busy and back; asked for GPU 1 alone (-i 1), it prints that one only
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\ncase "$*" in\n*"-i 1"*) while true; do echo "1, 2000, 10"; sleep 0.02; done ;;\n'
                    '*) while true; do echo "0, 1000, [N/A]"; echo "1, 500, 0"; sleep 0.02;'
                    ' echo "0, 1000, [N/A]"; echo "1, 3000, 100"; sleep 0.02; done ;;\nesac\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with bench.DeviceMemory(period_ms=20, fields=("utilization.gpu",)) as mem:
        _, total, per_gpu = bench.timed_on_devices(mem, lambda: time.sleep(0.3) or {})
    # the peak counts what both held in one cycle; a field nvidia-smi cannot give is None, the rest still read
    assert total == 4000
    assert per_gpu[0] == {"peak_mib": 1000, "utilization.gpu": None}
    assert per_gpu[1]["peak_mib"] == 3000 and 20 < per_gpu[1]["utilization.gpu"] < 80
    merged = bench.merge_devices([per_gpu, None, {0: {"peak_mib": 1200, "utilization.gpu": 50.0}}])
    assert merged["0"] == {"peak_mib": 1200, "utilization.gpu": 50.0} and merged["1"] == per_gpu[1]
    row = {"placement": "resident", "tokens": 600, "gpus": {"exact": merged, "ridgefill": merged},
           "devices": {"late_devices": 2, "bytes_moved": 3 * 2**20, "devices": "sweep one: CUDA0 0-14; late layers: "
                       "CUDA0 15-23, CUDA1 24-29"}}
    table = "\n".join(bench.split_table({"rows": [row]}))
    assert "| resident | 600 | exact | GPU 0: 1200 / 50%, GPU 1: 3000 / " in table
    assert "| 3.0 MiB over 2 late devices (sweep one: CUDA0 0-14; late layers: CUDA0 15-23, CUDA1 24-29) |" in table
    # one GPU: no table
    assert bench.split_table({"rows": [{**row, "gpus": {"exact": {"0": merged["0"]}}}]}) == []
    # a run on some of the GPUs (CUDA_VISIBLE_DEVICES) watches those alone: nvidia-smi does not read that variable
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with bench.DeviceMemory(period_ms=20, fields=("utilization.gpu",)) as mem:
        _, total, per_gpu = bench.timed_on_devices(mem, lambda: time.sleep(0.2) or {})
    assert total == 2000 and per_gpu == {1: {"peak_mib": 2000, "utilization.gpu": 10.0}}


def test_the_multi_gpu_script_runs_a_split_bench_and_a_one_gpu_bench_end_to_end(tmp_path):
    # the script's plumbing on the CPU builds, with a stand-in nvidia-smi of two GPUs: what a machine of several
    # GPUs runs, on a tiny model, so that a rare multi-GPU session spends no time on the script's own faults
    require_builds()
    work, out, bin_dir = tmp_path / "work", tmp_path / "out", tmp_path / "bin"
    for d in (work, out, bin_dir):
        d.mkdir()
    model = write_random_model(work / "tiny-f32.gguf", dataclasses.replace(tiny_shape("llama"), n_layer=4), seed=0)
    write_random_maps(model, 2, work / "tiny-f32.S2.maps.gguf")
    fake = bin_dir / "nvidia-smi"
    fake.write_text('#!/bin/sh\ncase "$*" in\n*-L*) echo "GPU 0: NVIDIA H100 80GB HBM3"; echo "GPU 1: NVIDIA H100 80GB '
                    'HBM3" ;;\n*name*) echo "NVIDIA H100 80GB HBM3" ;;\n*"-i 0"*) while true; do echo "0, 900, 50"; '
                    'sleep 0.05; done ;;\n*) while true; do echo "0, 900, 50"; echo "1, 700, 40"; sleep 0.05; done ;;'
                    '\nesac\n')
    fake.chmod(0o755)
    # the scripts call python3: this one, which has the project's packages
    path = f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "RIDGEFILL_GPU_WORK": str(work), "OUT": str(out),
           "PRESET": "tiny", "DTYPE": "f32", "SPLIT": "2", "RUNS": "split1k one1k", "TAIL": "256", "LIMIT_S": "300"}
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu" / "multi-gpu-runs.sh")], text=True, capture_output=True,
                          timeout=900, env=env)
    assert proc.returncode == 0 and "stopped" not in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    subprocess.run(["tar", "-xJf", str(out / "multi-gpu.tar.xz"), "-C", str(tmp_path)], check=True)
    results = {p.stem.rsplit("-", 1)[-1]: json.loads(p.read_text()) for p in (tmp_path / "bench").glob("*.json")}
    assert set(results) == {"split1k", "one1k"}, list(results)
    split, one = results["split1k"], results["one1k"]
    assert "-sm layer" in split["server_commands"]["resident"] and "-sm layer" in split["server_commands"]["upstream"]
    assert [r["tokens"] for r in split["off_vs_upstream"]] == [1024] and not one["off_vs_upstream"]
    assert [r["placement"] for r in split["rows"]] == ["resident", "streamed"] and split["selectors"]
    assert set(split["rows"][0]["gpus"]["ridgefill"]) == {"0", "1"}
    assert split["rows"][0]["gpus"]["ridgefill"]["1"]["peak_mib"] == 700
    md = next((tmp_path / "bench").glob("*-split1k.md")).read_text()
    assert "| resident | 1024 | ridgefill | GPU 0: 900 / 50%, GPU 1: 700 / 40% |" in md, md
    assert "| upstream | 1024 | upstream (the off server loaded too) | GPU 0: 900 / 50%" in md
    # the run on the first GPU alone watched it alone
    assert set(one["rows"][0]["gpus"]["ridgefill"]) == {"0"} and one["rows"][0]["peak_memory_mib"]["ridgefill"] == 900
    assert "Each GPU" not in next((tmp_path / "bench").glob("*-one1k.md")).read_text()
