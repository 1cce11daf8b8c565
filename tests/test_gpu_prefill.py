"""On CUDA, with every layer on the GPU: resident and streamed maps give the same bytes (rung 2), and plumb,
oracle and a prefill with nothing filled reproduce stock within the exact-vs-exact noise floor (rung 3), and the
probe, the budgeted probe (the default selector) and the attention selector keep the rows a NumPy computation
ranks highest; the masks made in the graphs give the bytes of llama.cpp's host-made ones."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import assert_same_bytes, require_cuda_builds
from ridgefill_gguf.maps.convert import convert
from ridgefill_gguf.maps.synthetic import write_float_file, write_random_maps
from ridgefill_gguf.random_gguf import tiny_shape, write_random_model
from test_engine_prefill import deep_tiny  # noqa: F401  (a fixture)
from test_engine_prefill import (SELECTOR_TAIL, SPLIT, TIGHT, check_budgeted_probe, kl, reference_and_maps, run_engine,
                                 run_selector)

pytestmark = pytest.mark.gpu

LONG = "Filled rows write their late-layer cache from a prediction; the tail runs every layer. " * 60
GPU = {"n_gpu_layers": -1, "flash_attn": True, "n_batch": 512, "n_ubatch": 128}


@pytest.fixture(scope="module")
def model_and_maps(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu-prefill")
    shape = dataclasses.replace(tiny_shape("qwen3"), n_layer=6)
    model = write_random_model(d / "qwen3.gguf", shape, dtype="q8_0", seed=7)
    return model, write_random_maps(model, 2, d / "maps.gguf")


def test_resident_and_streamed_maps_give_byte_identical_logits_on_cuda(model_and_maps, tmp_path):
    require_cuda_builds("ridgefill")
    model, maps = model_and_maps
    runs = [{"name": "ridge", "params": {"fill": "ridge", "tail": 128, "chunk": 256, "min_prefix": 0}}]
    resident, _ = run_engine(model, maps, runs, session=GPU, prompt=LONG, n_ctx=2048, tmp_path=tmp_path)
    streamed, st = run_engine(model, maps, runs, session={**GPU, "placement": "streamed"}, prompt=LONG,
                              n_ctx=2048, tmp_path=tmp_path)
    assert st["ridge"]["applied"] == 1 and st["ridge"]["n_filled"] > 0
    assert_same_bytes(resident["ridge"], streamed["ridge"])


def test_streamed_maps_give_the_resident_bytes_with_the_probe_when_each_fill_outlasts_the_next_copy_on_cuda(
        tmp_path):
    # The probe's pass queues every late layer's fill without waiting; the copy of a later layer's map lands in the
    # staging slot an earlier fill reads, on another stream. 32K rows and small Q8_0 maps make a fill outlast the
    # next copy, so a copy that did not wait for the fills before it would change these bytes.
    require_cuda_builds("ridgefill")
    shape = dataclasses.replace(tiny_shape("llama"), n_layer=8, n_embd=1024, n_ff=2048, n_head=8, n_head_kv=4,
                                head_dim=128, n_ctx_train=65536)
    model = write_random_model(tmp_path / "llama.gguf", shape, dtype="q8_0", seed=7)
    maps = write_random_maps(model, 2, tmp_path / "maps.gguf")
    tokens = [1000 + (i * 7919) % 20000 for i in range(32768)]
    runs = [{"name": "probe", "params": {"fill": "ridge", "tail": 1024, "min_prefix": 0, "probe": [256, 2048]}},
            {"name": "ridge", "params": {"fill": "ridge", "tail": 1024, "min_prefix": 0}}]
    session = {**GPU, "n_batch": 2048, "n_ubatch": 512}
    out = {p: run_engine(model, maps, runs, session={**session, "placement": p}, tokens=tokens, n_ctx=33792,
                         tmp_path=tmp_path) for p in ("resident", "streamed")}
    for run in runs:
        assert out["streamed"][1][run["name"]]["applied"] == 1, run["name"]
        assert_same_bytes(out["resident"][0][run["name"]], out["streamed"][0][run["name"]], run["name"])


def test_plumb_oracle_and_nothing_filled_stay_within_the_noise_floor_on_cuda(model_and_maps, tmp_path):
    require_cuda_builds("ridgefill")
    model, maps = model_and_maps
    runs = [{"name": "stock", "stock": True},
            {"name": "plumb", "params": {"fill": "plumb", "tail": 128, "min_prefix": 0}},
            {"name": "oracle", "params": {"fill": "oracle"}},
            {"name": "nothing_filled", "params": {"fill": "ridge", "tail": 100000}}]
    arrays, stats = run_engine(model, maps, runs, session=GPU, prompt=LONG, n_ctx=2048, tmp_path=tmp_path)
    # the floor: stock against stock with another ubatch size
    other, _ = run_engine(model, maps, [{"name": "stock", "stock": True}], session={**GPU, "n_ubatch": 64},
                          prompt=LONG, n_ctx=2048, tmp_path=tmp_path)
    floor = kl(arrays["stock"], other["stock"])
    for name in ("plumb", "oracle", "nothing_filled"):
        d = kl(arrays["stock"], arrays[name])
        print(f"{name}: KL {d:.3g} (floor {floor:.3g}), stats {stats[name]}")
        assert stats[name]["applied"] == 1
        assert arrays[name].argmax() == arrays["stock"].argmax()
        assert d <= max(10 * floor, 1e-5), (name, d, floor)


def test_the_probe_on_cuda_keeps_the_rows_numpy_ranks_highest(tmp_path):
    require_cuda_builds("ridgefill")
    shape = dataclasses.replace(tiny_shape("qwen3"), n_layer=4)
    model = write_random_model(tmp_path / "qwen3.gguf", shape, seed=3)
    src = write_float_file(tmp_path / "maps.safetensors", SPLIT, [2, 3], shape.n_embd, dtype="f32", seed=4)
    maps = convert(src, tmp_path / "maps.gguf", model=model, outtype="f32").out
    tail, n_probe, n_exact = 40, 16, 8
    runs = [{"name": "probe", "params": {"fill": "ridge", "tail": tail, "min_prefix": 0, "probe": [n_probe, n_exact]}}]
    arrays, stats = run_engine(model, maps, runs, session={**TIGHT, "n_gpu_layers": -1}, tmp_path=tmp_path)
    tokens = arrays["tokens"].tolist()
    ref, mats = reference_and_maps(model, maps)
    score = ref.probe_scores(tokens[:-1], SPLIT, tail - 1, n_probe, mats)
    ranked = sorted(range(1, len(tokens) - tail), key=lambda r: -score[r])
    assert stats["probe"]["exact_rows"] == [0] + sorted(ranked[:n_exact])


# cuBLAS sums in another order than NumPy: the logits agree to this, the chosen rows exactly
CUDA_TOLERANCE = 1e-3


def test_the_budgeted_probe_on_cuda_counts_e_and_keeps_the_rows_the_rules_and_numpy_choose(deep_tiny, tmp_path):
    require_cuda_builds("ridgefill")
    check_budgeted_probe("llama", deep_tiny, tmp_path, {**TIGHT, "n_gpu_layers": -1}, CUDA_TOLERANCE)


def test_the_attention_selector_on_cuda_keeps_the_rows_numpy_ranks_highest_below_the_split(deep_tiny, tmp_path):
    require_cuda_builds("ridgefill")
    n_query, share = 24, 0.1

    def scores(ref, mats, prompt):
        prefix = len(prompt) + 1 - SELECTOR_TAIL
        return ref.attention_scores(prompt, [0], n_query), int(share * prefix + 0.5)

    run_selector("qwen2", deep_tiny, tmp_path, {"attention": [n_query, share, [0]]}, scores,
                 {**TIGHT, "n_gpu_layers": -1}, CUDA_TOLERANCE)


@pytest.mark.parametrize("flash_attn", [True, False])
def test_masks_made_in_the_graphs_give_the_bytes_of_llama_cpps_host_made_masks_on_cuda(flash_attn, model_and_maps,
                                                                                         tmp_path):
    require_cuda_builds("ridgefill")
    model, maps = model_and_maps
    base = {"fill": "ridge", "tail": 128, "chunk": 256, "min_prefix": 0}
    runs = [{"name": "ridge", "params": base}, {"name": "probe", "params": {**base, "probe": [64, 32]}}]
    session = {**GPU, "flash_attn": flash_attn}
    device, st = run_engine(model, maps, runs, session=session, prompt=LONG, n_ctx=2048, tmp_path=tmp_path)
    host, st_host = run_engine(model, maps, runs, session=session, prompt=LONG, n_ctx=2048, tmp_path=tmp_path,
                               env={"LLAMA_RIDGEFILL_HOST_MASK": "1"})
    for name in ("ridge", "probe"):
        assert st[name]["applied"] == 1 and st[name]["exact_rows"] == st_host[name]["exact_rows"]
        assert (st[name]["device_mask"], st_host[name]["device_mask"]) == (1, 0), "each path ran"
        assert_same_bytes(device[name], host[name], name)


def test_sweep_one_and_the_stock_prefills_after_ridgefill_never_reallocate_between_ubatches_on_cuda(model_and_maps,
                                                                                                     tmp_path):
    """llama.cpp reserves the worst-case prompt graph so that its scheduler never reallocates between ubatches:
    a reallocation first waits for the GPU, and the host stops preparing ubatch i+1 while ubatch i computes (stock
    prefills ran 6-9% slower after a RidgeFill request on the H200 until patch 0018). GGML_SCHED_DEBUG_REALLOC=1
    aborts the process on a reallocation between graphs of one size."""
    require_cuda_builds("ridgefill")
    model, maps = model_and_maps
    base = {"fill": "ridge", "tail": 128, "chunk": 256, "min_prefix": 0}
    # plain RidgeFill only: the probe's pass alternates graphs of one size with different row counts, which this
    # check would count although they are not what the reservations are for
    runs = [{"name": "stock-before", "stock": True}, {"name": "ridge", "params": base},
            {"name": "stock-after", "stock": True}]
    logits, st = run_engine(model, maps, runs, session=GPU, prompt=LONG, n_ctx=2048, tmp_path=tmp_path,
                            env={"GGML_SCHED_DEBUG_REALLOC": "1"})
    assert st["ridge"]["applied"] == 1
    assert_same_bytes(logits["stock-before"], logits["stock-after"])
