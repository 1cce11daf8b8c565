"""RidgeFill's memory: its buffers are sized when the maps are attached, from the context (x_S for every row the
context holds, the exact rows' mask for one chunk, the inputs for the tail, the probe's), a prefill whose exact rows
fit the tail allocates nothing more, and the exact rows' mask holds one chunk whatever their number: where every
fill runs first (resident or streamed maps), each chunk runs all late layers in turn, in the rows attach made for the
exact rows' inputs, and its mask is made once; a hybrid's carry groups pass the late layers in runs that fit those
rows, with either placement; the parameters that take the layer-major order (the rescales here) make room for every
row when set; forced into that order (LLAMA_RIDGEFILL_LAYER_MAJOR=1) without them, the inputs grow to every exact row
and the mask is made once per layer; the same logits byte for byte."""
from __future__ import annotations

import json

import pytest

from conftest import assert_same_bytes, require_builds, run_py
from ridgefill_gguf.maps.synthetic import tiny_model_with_maps
from ridgefill_gguf.random_gguf import ModelShape

N_CTX, N_UBATCH, TAIL, N_PROMPT, N_MANY = 2048, 32, 40, 1500, 1200

SCRIPT = r'''
import json
import numpy as np
from ridgefill_gguf.engine.session import Session
from ridgefill_gguf.engine import bindings as B

cfg = json.loads(CFG)
out = {}
for name, placement in cfg["placements"]:
    S = Session(cfg["model"], n_ctx=cfg["n_ctx"], n_batch=64, n_ubatch=cfg["n_ubatch"], n_threads=2)
    S.attach(cfg["maps"], placement)
    at_attach = B.buffer_bytes(S.ctx)
    B.configure(S.ctx, probe_budget=[16, 0], chunk=48, min_prefix=0, tail=cfg["tail"])
    with_probe = B.buffer_bytes(S.ctx)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(1000, 5000, cfg["n_prompt"])]
    B.configure(S.ctx, probe_budget=[0, 0])
    logits_tail, _, st_tail = S.ridgefill(tokens)
    after_tail = B.buffer_bytes(S.ctx)
    logits, _, st = S.ridgefill(tokens, exact_rows=list(range(10, 10 + cfg["n_many"])))
    after_many = B.buffer_bytes(S.ctx)
    B.configure(S.ctx, probe=[16, 8])  # the listed rows run exactly in the probe's pass as well
    _, _, st_probe = S.ridgefill(tokens, exact_rows=list(range(10, 10 + cfg["n_many"])))
    B.configure(S.ctx, probe=[0, 0])
    after_probe_many = B.buffer_bytes(S.ctx)
    B.configure(S.ctx, rescale=[16, True, False])  # the layer-major order: room for every row's input
    with_rescale = B.buffer_bytes(S.ctx)
    _, _, st_rescale = S.ridgefill(tokens, exact_rows=list(range(10, 10 + cfg["n_many"])))
    after_rescale = B.buffer_bytes(S.ctx)
    B.configure(S.ctx, rescale=[0, False, False])
    out[name] = {"at_attach": at_attach, "with_probe": with_probe, "after_tail": after_tail,
                      "after_many": after_many, "after_probe_many": after_probe_many,
                      "with_rescale": with_rescale, "after_rescale": after_rescale,
                      "rescale_exact": st_rescale["n_exact"],
                      "probe_exact": st_probe["n_probe_exact"], "tail_masks": st_tail["n_masks_made"],
                      "masks": st["n_masks_made"], "n_exact": st["n_exact"], "n_tail": st["n_tail"],
                      "applied": st["applied"], "device_mask": st["device_mask"],
                      "logits": logits.tobytes().hex(), "logits_tail": logits_tail.tobytes().hex()}
    S.close()
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def llama_with_maps(tmp_path_factory):
    return tiny_model_with_maps(tmp_path_factory.mktemp("engine-memory"), "llama", n_layer=4, split=1)


@pytest.fixture(scope="module")
def hybrid_with_maps(tmp_path_factory):
    """qwen35's tiny shape over 4 layers at split 1: two late DeltaNet layers, then an attention layer"""
    return tiny_model_with_maps(tmp_path_factory.mktemp("engine-memory-hybrid"), "qwen35", n_layer=4, split=1)


def run_orders(model, maps) -> dict:
    require_builds("ridgefill")
    cfg = {"model": str(model), "maps": str(maps), "n_ctx": N_CTX, "n_ubatch": N_UBATCH, "tail": TAIL,
           "n_prompt": N_PROMPT, "n_many": N_MANY}
    out = {}
    for placements, env in (([("resident", "resident"), ("streamed", "streamed")], {}),
                            ([("layer_major", "resident")], {"LLAMA_RIDGEFILL_LAYER_MAJOR": "1"})):
        code = SCRIPT.replace("CFG", repr(json.dumps({**cfg, "placements": placements})))
        proc = run_py(code, build="ridgefill", extra_env=env)
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
        out.update(json.loads(line[len("RESULT "):]))
    return out


@pytest.fixture(scope="module")
def result(llama_with_maps):
    model, maps = llama_with_maps
    return run_orders(model, maps), model


@pytest.fixture(scope="module")
def hybrid_result(hybrid_with_maps):
    model, maps = hybrid_with_maps
    return run_orders(model, maps), model


def expected_at_attach(model) -> int:
    """x_S for every row, the mask for one chunk of exact rows (flash attention off: a ubatch, F32, over every
    cell), the inputs of the default tail and position 0 twice (read from one, written to the other)."""
    d = ModelShape.from_gguf(model).n_embd
    return 4 * d * N_CTX + 4 * N_CTX * N_UBATCH + 2 * 4 * d * (1024 + 1)  # the tiny maps carry no tail_default


def test_attach_sizes_the_buffers_from_the_context_and_a_prefill_within_the_tail_allocates_nothing(result):
    res, model = result
    for placement in ("resident", "streamed"):
        r = res[placement]
        assert r["at_attach"] == expected_at_attach(model), (placement, r)
        assert r["with_probe"] > r["at_attach"]  # the probe's rows, mask and scores, once its parameters are set
        assert r["after_tail"] == r["with_probe"], r
    # on the CPU a streamed map is read where it lies in host memory: no staging slots (a device holding late
    # layers gets two of its largest map; tests/test_devices_rpc.py)


def test_more_exact_rows_than_the_tail_run_in_attachs_buffers_chunk_major_and_grow_only_their_inputs_layer_major(result):
    res, model = result
    n_run = N_MANY + 1 + TAIL - 1  # the listed rows, position 0 (always exact) and this call's tail
    for name in ("resident", "streamed", "layer_major"):
        r = res[name]
        assert r["applied"] == 1 and r["n_exact"] == N_MANY + 1 and r["n_tail"] == TAIL - 1, (name, r)
    # resident and streamed maps take the chunk-major order, whose chunks reuse x_ex's rows in turn, as do the
    # known exact rows in the probe's pass
    for name in ("resident", "streamed"):
        r = res[name]
        assert r["after_many"] == r["after_tail"] and r["probe_exact"] == 8, (name, r)
        assert r["after_probe_many"] == r["after_tail"], (name, r)
    # in the layer-major order every run row's input waits for the next layer
    r = res["layer_major"]
    assert r["after_many"] - r["after_tail"] == 2 * 4 * ModelShape.from_gguf(model).n_embd * (n_run - 1025), r


def test_each_chunk_runs_every_late_layer_in_turn_so_its_mask_is_made_once(result):
    res, _ = result
    chunks = -(-(N_MANY + 1 + TAIL - 1) // N_UBATCH)
    late_layers = 4 - 1
    for name in ("resident", "streamed"):
        assert res[name]["masks"] == chunks and res[name]["tail_masks"] == 2, (name, res[name])  # the tail: 2 chunks
        assert res[name]["device_mask"] == 1
    # the layer-major order makes each chunk's mask again at every late layer
    assert res["layer_major"]["masks"] == chunks * late_layers, res["layer_major"]
    assert res["layer_major"]["tail_masks"] == 2 * late_layers


def test_chunk_major_and_layer_major_orders_and_both_placements_give_the_same_logits_byte_for_byte(result):
    res, _ = result
    for name in ("streamed", "layer_major"):
        for key in ("logits", "logits_tail"):
            assert_same_bytes(bytes.fromhex(res["resident"][key]), bytes.fromhex(res[name][key]), (name, key))


def test_a_hybrids_groups_pass_the_late_layers_together_in_attachs_buffers_with_resident_and_streamed_maps(hybrid_result):
    # attach makes room for a carry graph's rows (the default chunk, 4,096, capped by the context: every row here);
    # the carry's groups (48 rows each once configured) run every late layer in runs whose exact rows fit the tail's
    # room (1,025 rows), so 1,240 run rows take two runs, and streamed maps cross once a run
    res, model = hybrid_result
    d = ModelShape.from_gguf(model).n_embd
    for name in ("resident", "streamed", "layer_major"):
        r = res[name]
        assert r["applied"] == 1 and r["n_exact"] == N_MANY + 1 and r["n_tail"] == TAIL - 1, (name, r)
        assert r["after_many"] == r["after_tail"] and r["after_probe_many"] == r["after_tail"], (name, r)
    assert res["resident"]["at_attach"] - res["streamed"]["at_attach"] == 0  # the CPU stages no streamed map
    assert res["resident"]["at_attach"] - expected_at_attach(model) == 2 * 4 * d * (N_CTX - 1025), res["resident"]


def test_a_hybrids_runs_of_groups_and_the_layer_major_order_give_the_same_logits_byte_for_byte(hybrid_result):
    res, _ = hybrid_result
    for name in ("streamed", "layer_major"):
        for key in ("logits", "logits_tail"):
            assert_same_bytes(bytes.fromhex(res["resident"][key]), bytes.fromhex(res[name][key]), (name, key))


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_the_rescales_make_room_for_every_rows_input_when_set_so_a_prefill_with_them_grows_nothing(arch, result,
                                                                                                   hybrid_result):
    # the rescales take the layer-major order, where every exact row's input waits at each late layer: setting them
    # sizes the inputs for the context's every row (which --fit counts where the server's flags set them)
    res, model = result if arch == "llama" else hybrid_result
    shape = ModelShape.from_gguf(model)
    norms = 4 * 4 * shape.n_head_kv * 16  # per KV head four norms for each of the 16 measuring rows
    at_attach = 1025 if arch == "llama" else N_CTX  # the tail's room, or a hybrid's carry graph (every row here)
    for name in ("resident", "streamed"):
        r = res[name]
        assert r["with_rescale"] - r["after_probe_many"] == 2 * 4 * shape.n_embd * (N_CTX - at_attach) + norms, r
        assert r["after_rescale"] == r["with_rescale"] and r["rescale_exact"] == N_MANY + 1, (name, r)
