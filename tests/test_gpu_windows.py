"""On CUDA, every layer on the GPU, the tiny random gemma3 of tests/test_engine_windows.py (windows of 32 rows, split
2, late layers 3 and 4 windowed and 5 global): resident and streamed maps give the same bytes; plumb, the oracle and a
prefill with nothing filled reproduce stock within the exact-vs-exact noise floor; the window-aware fill gives the
bytes of the full fill; the masks made in the graphs with the window give the bytes of llama.cpp's host-made ones;
the ridge arm stays near NumPy's."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_same_bytes, require_cuda_builds
from test_engine_prefill import kl, reference_and_maps, run_engine
from test_engine_windows import FULL, LONG, SPLIT, gemma3, gemma3_270m  # noqa: F401  (fixtures)

pytestmark = pytest.mark.gpu

GPU = {"n_gpu_layers": -1, "flash_attn": True, "n_batch": 64, "n_ubatch": 32, **FULL}
BASE = {"fill": "ridge", "tail": 40, "chunk": 48, "min_prefix": 0}


def test_resident_and_streamed_maps_give_byte_identical_logits_on_a_sliding_window_model_on_cuda(gemma3, tmp_path):
    require_cuda_builds("ridgefill")
    model, maps = gemma3
    runs = [{"name": "ridge", "params": BASE}, {"name": "probe", "params": {**BASE, "probe": [16, 8]}}]
    out = {p: run_engine(model, maps, runs, session={**GPU, "placement": p}, tmp_path=tmp_path)[0]
           for p in ("resident", "streamed")}
    for run in runs:
        assert_same_bytes(out["resident"][run["name"]], out["streamed"][run["name"]], run["name"])


def test_plumb_oracle_and_nothing_filled_on_a_sliding_window_model_stay_within_the_noise_floor_on_cuda(gemma3,
                                                                                                       tmp_path):
    require_cuda_builds("ridgefill")
    model, maps = gemma3
    runs = [{"name": "stock", "stock": True}, {"name": "plumb", "params": {**BASE, "fill": "plumb"}},
            {"name": "oracle", "params": {**BASE, "fill": "oracle"}},
            {"name": "nothing_filled", "params": {**BASE, "tail": 100000}}]
    arrays, stats = run_engine(model, maps, runs, session=GPU, tmp_path=tmp_path)
    other, _ = run_engine(model, maps, runs[:1], session={**GPU, "n_ubatch": 16}, tmp_path=tmp_path)
    floor = kl(arrays["stock"], other["stock"])
    for name in ("plumb", "oracle", "nothing_filled"):
        d = kl(arrays["stock"], arrays[name])
        print(f"{name}: KL {d:.3g} (floor {floor:.3g})")
        assert stats[name]["applied"] == 1 and arrays[name].argmax() == arrays["stock"].argmax(), name
        assert d <= max(10 * floor, 1e-5), (name, d, floor)


@pytest.mark.parametrize("params", [{}, {"exact_rows": [40, 41, 120]}], ids=["plain", "exact-rows"])
def test_the_window_aware_fill_gives_the_bytes_of_the_full_fill_on_cuda(params, gemma3, tmp_path):
    require_cuda_builds("ridgefill")
    model, maps = gemma3
    runs = [{"name": "rows", "rows": 40, "params": {**BASE, **params}},
            {"name": "decode", "params": {**BASE, **params}}]
    skipped, st = run_engine(model, maps, runs, session=GPU, tmp_path=tmp_path)
    every, _ = run_engine(model, maps, runs, session=GPU, tmp_path=tmp_path,
                          env={"LLAMA_RIDGEFILL_FULL_WINDOW_FILL": "1"})
    assert st["decode"]["n_fill_skipped"] > 0
    for name in ("rows", "decode"):
        assert_same_bytes(skipped[name], every[name], name)


def test_the_window_aware_fill_with_the_probe_keeps_its_rows_and_stays_within_the_noise_floor_on_cuda(gemma3,
                                                                                                    tmp_path):
    # Byte-identical on the CPU. On CUDA a float matrix product takes another kernel for up to 8 or 16 rows than for
    # more (mmvf, mmf, cuBLAS), and the probe's pass fills a windowed layer's reached rows in chunks of other sizes
    # than the full fill: the same row may get other bytes (seen once: the bytes differed).
    require_cuda_builds("ridgefill")
    model, maps = gemma3
    runs = [{"name": "probe", "params": {**BASE, "probe": [16, 8]}}]
    skipped, st = run_engine(model, maps, runs, session=GPU, tmp_path=tmp_path)
    every, st_every = run_engine(model, maps, runs, session=GPU, tmp_path=tmp_path,
                                 env={"LLAMA_RIDGEFILL_FULL_WINDOW_FILL": "1"})
    stock, _ = run_engine(model, maps, [{"name": "stock", "stock": True}], session=GPU, tmp_path=tmp_path)
    other, _ = run_engine(model, maps, [{"name": "stock", "stock": True}], session={**GPU, "n_ubatch": 16},
                          tmp_path=tmp_path)
    floor, d = kl(stock["stock"], other["stock"]), kl(every["probe"], skipped["probe"])
    print(f"window-aware against full fill with the probe: KL {d:.3g} (floor {floor:.3g})")
    assert st["probe"]["n_fill_skipped"] > 0 and st["probe"]["exact_rows"] == st_every["probe"]["exact_rows"]
    assert d <= max(10 * floor, 1e-5), (d, floor)


@pytest.mark.parametrize("flash_attn", [False, True])
def test_masks_made_in_the_graphs_with_the_window_give_the_bytes_of_host_made_masks_on_cuda(flash_attn, gemma3,
                                                                                           tmp_path):
    require_cuda_builds("ridgefill")
    model, maps = gemma3
    arms = (("ridge", {}), ("rows", {"exact_rows": [40, 41, 120]}), ("probe", {"probe": [16, 8]}))
    runs = [{"name": name, "params": {**BASE, **extra}} for name, extra in arms]
    session = {**GPU, "flash_attn": flash_attn, "n_ubatch": 16}
    device, st = run_engine(model, maps, runs, session=session, tmp_path=tmp_path)
    host, st_host = run_engine(model, maps, runs, session=session, tmp_path=tmp_path,
                               env={"LLAMA_RIDGEFILL_HOST_MASK": "1"})
    for name, _ in arms:
        assert (st[name]["device_mask"], st_host[name]["device_mask"]) == (1, 0), "each path ran"
        assert st[name]["exact_rows"] == st_host[name]["exact_rows"], name
        assert_same_bytes(device[name], host[name], name)


def test_the_ridge_arm_on_a_sliding_window_model_stays_near_numpy_on_cuda(gemma3, tmp_path):
    require_cuda_builds("ridgefill")
    model, maps = gemma3
    runs = [{"name": "stock", "stock": True}, {"name": "ridge", "params": {**BASE, "exact_rows": []}}]
    arrays, stats = run_engine(model, maps, runs, session={**GPU, "f32_cache": True}, tmp_path=tmp_path)
    ref, mats = reference_and_maps(model, maps)
    tokens = arrays["tokens"].tolist()

    def rel(got, want):
        return float(np.abs(got - want).max() / np.abs(want).max())

    # the floor: CUDA's stock prefill against NumPy's (CUDA's kernels, F16 flash attention)
    floor = rel(arrays["stock"], ref.forward(tokens)[0][-1])
    err = rel(arrays["ridge"], ref.ridgefill_forward(tokens, SPLIT, BASE["tail"], "ridge", mats)[-1])
    print(f"gemma3 ridge on CUDA against NumPy: rel {err:.2e} (stock: {floor:.2e}), "
          f"{stats['ridge']['n_fill_skipped']} fills skipped")
    assert stats["ridge"]["applied"] == 1 and stats["ridge"]["n_fill_skipped"] > 0
    assert err < max(3 * floor, 5e-4), (err, floor)


def test_a_one_window_cache_on_cuda_moves_ridgefills_logits_as_little_as_stocks(gemma3, tmp_path):
    # llama.cpp's default windowed cache (256 cells under a global 1,024, a 690-row prompt): the late windowed
    # layers reuse its cells as a ring; CUDA's kernels see other cell counts, so stock's logits move too
    from test_engine_windows import ONE_WINDOW, RING_CTX, RING_PROMPT, RING_ROWS

    require_cuda_builds("ridgefill")
    model, maps = gemma3
    runs = [{"name": "stock", "stock": True}, {"name": "ridge", "params": BASE},
            {"name": "rows", "params": {**BASE, "exact_rows": RING_ROWS}},
            {"name": "probe", "params": {**BASE, "probe": [16, 8]}}]
    out, st = {}, {}
    for name, cache in (("ring", ONE_WINDOW), ("full", FULL)):
        out[name], st[name] = run_engine(model, maps, runs, session={**GPU, **cache}, prompt=RING_PROMPT,
                                         n_ctx=RING_CTX, tmp_path=tmp_path)
    floor = kl(out["full"]["stock"], out["ring"]["stock"])
    for name in ("ridge", "rows", "probe"):
        moved = kl(out["full"][name], out["ring"][name])
        print(f"{name}: KL {moved:.3g} (stock's {floor:.3g})")
        assert st["ring"][name]["applied"] == 1 and st["ring"][name]["n_exact"] == st["full"][name]["n_exact"]
        assert out["ring"][name].argmax() == out["full"][name].argmax() and moved <= max(10 * floor, 1e-5), name


def test_gemma_3_270m_on_cuda_is_upstreams_bytes_with_ridgefill_off_and_plumb_stays_within_its_floor(gemma3_270m,
                                                                                                      tmp_path):
    # the real model, carried in pieces (tools/gpu/chunks.sh; RIDGEFILL_GGUF_MODELS=$HOME/ridgefill/models)
    from ridgefill_gguf import equivalence
    from ridgefill_gguf.logits import Case

    require_cuda_builds("ridgefill", "upstream")
    model, maps = gemma3_270m
    report = equivalence.check(model, [LONG, "short prompt"], n_ctx=2048, decode_steps=3, maps=maps,
                               n_gpu_layers=-1,
                               cases=[Case(512, 512, True), Case(512, 512, False), Case(256, 64, True)])
    bad = [r["key"] for r in report["arrays"] if not r["identical"]]
    assert report["n_logits"] > 100_000 and not bad, f"arrays differ: {bad}"
    base = {"tail": 256, "min_prefix": 0}
    runs = [{"name": "stock", "stock": True}, {"name": "plumb", "params": {"fill": "plumb", **base}},
            {"name": "ridge", "params": {"fill": "ridge", **base}}]
    # flash attention off: the exact path is stock's to the floor (KL 0 on an H100). On, this model's own logits move
    # with the kernel's shape (other row counts and cache views take other tilings), so its floor is what stock
    # itself moves between ubatch 32 and 512, or between flash attention on and off, whichever is more
    stock = {}
    for flash_attn, other_ubatch in ((False, 64), (True, 512)):
        session = {"n_gpu_layers": -1, "flash_attn": flash_attn, **FULL}
        arrays, stats = run_engine(model, maps, runs, prompt=LONG, n_ctx=2048, session=session, tmp_path=tmp_path)
        other, _ = run_engine(model, maps, runs[:1], prompt=LONG, n_ctx=2048, tmp_path=tmp_path,
                              session={**session, "n_batch": other_ubatch, "n_ubatch": other_ubatch})
        stock[flash_attn] = arrays["stock"]
        floor, moved = kl(arrays["stock"], other["stock"]), kl(arrays["stock"], arrays["plumb"])
        if flash_attn:
            floor = max(floor, kl(stock[True], stock[False]))
        print(f"flash attention {flash_attn}: plumb KL {moved:.3g}, floor {floor:.3g}")
        assert stats["plumb"]["applied"] == 1 and stats["ridge"]["n_fill_skipped"] > 0
        assert moved <= (floor if flash_attn else max(10 * floor, 1e-5)), (flash_attn, moved, floor)
