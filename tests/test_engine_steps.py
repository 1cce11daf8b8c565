"""The RidgeFill prefill in steps (llama_ridgefill_prefill_begin/_step/_cancel), as llama-server runs it while other
users decode on the same context: another sequence's decode steps between its late-layer steps change no byte of
either sequence, between its sweep-one batches only the cells' order (float noise), a cancelled prefill leaves
nothing behind, and a hybrid yields through its late layers too, while other sequences' batches move its recurrent
cell."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import assert_same_bytes, require_builds, run_py
from ridgefill_gguf.maps.synthetic import tiny_model_with_maps

PARAMS = {"tail": 40, "fill": "ridge", "exact_rows": [], "chunk": 48, "min_prefix": 0, "probe": [16, 8]}

SCRIPT = r'''
import json, math, sys
import numpy as np
from ridgefill_gguf.engine.session import Session
from ridgefill_gguf.engine import bindings as B

cfg = json.loads(sys.argv[1])
S = Session(cfg["model"], n_ctx=1024, n_batch=64, n_ubatch=32, n_threads=2, maps=cfg["maps"], n_seq_max=2,
            kv_unified=cfg["unified"])
rng = np.random.default_rng(0)
mine = [int(t) for t in rng.integers(1000, 5000, 300)]
other_prompt = [int(t) for t in rng.integers(1000, 5000, 80)]
other_tokens = [int(t) for t in rng.integers(1000, 5000, 8)]
sweep_one_steps = math.ceil((len(mine) - 1) / 64)
lc = S.lc

def pos_max(seq):
    return lc.llama_memory_seq_pos_max(lc.llama_get_memory(S.ctx), seq)

def other_prefill():
    for i in range(0, len(other_prompt), 64):
        S._decode(other_prompt[i:i + 64], i, seq=1)

def run(interleave):
    """seq 1 holds a prompt and decodes its tokens one per yield (none: all after the prefill)."""
    S.clear()
    other_prefill()
    other, refused, n_steps = [], None, 0
    def other_step():
        S._decode([other_tokens[len(other)]], len(other_prompt) + len(other), "last", seq=1)
        other.append(S._last_logits())
    def between(may):
        nonlocal refused, n_steps
        n_steps += 1
        if interleave == "probe_refused" and n_steps == 2:
            try:
                B.configure(S.ctx, **cfg["params"])
            except Exception as e:
                refused = str(e)
            else:
                refused = ""
        late = n_steps >= sweep_one_steps
        if may and len(other) < len(other_tokens) and (interleave == "all" or (interleave == "late" and late)):
            other_step()
    B.configure(S.ctx, **cfg["params"])
    yields = B.prefill_between(S.ctx, mine[:-1], between, seq=0, n_following=1)
    n_during = len(other)
    st = B.stats(S.ctx)
    while len(other) < len(other_tokens):
        other_step()
    S._decode(mine[-1:], len(mine) - 1, "last", seq=0)
    out = {"yields": yields, "during": n_during, "exact": st["n_exact"], "filled": st["n_filled"],
           "applied": st["applied"], "exact_rows": B.exact_rows(S.ctx)}
    if interleave == "probe_refused":
        out["refused"] = refused
    return S._last_logits(), np.stack(other), out

res = {}
arrays = {}
for arm in ("none", "late", "all", "probe_refused"):
    m, o, info = run(arm)
    arrays[arm + "_mine"], arrays[arm + "_other"] = m, o
    res[arm] = info

# cancelled after two steps: nothing of seq 0 stays, seq 1 untouched, and the next prefill gives the same bytes
S.clear()
other_prefill()
B.configure(S.ctx, **cfg["params"])
gen = B.prefill_steps(S.ctx, mine[:-1], seq=0, n_following=1)
next(gen); next(gen)
active = B.prefill_active(S.ctx)
gen.close()
res["cancel"] = {"active_during": active, "active_after": B.prefill_active(S.ctx), "pos_max_0": pos_max(0),
                 "pos_max_1": pos_max(1)}
m, o, info = run("none")
arrays["after_cancel_mine"] = m
np.savez(cfg["out"], **arrays)
print("RESULT " + json.dumps(res))
'''


@pytest.fixture(scope="module")
def llama_with_maps(tmp_path_factory):
    return tiny_model_with_maps(tmp_path_factory.mktemp("engine-steps"), "llama", n_layer=4, split=1)


def run_script(script: str, cfg: dict) -> dict:
    """One of the scripts above in a process of the patched build, cfg in place of its argument: its RESULT."""
    code = script.replace("cfg = json.loads(sys.argv[1])", f"cfg = json.loads({json.dumps(json.dumps(cfg))})")
    line = [l for l in run_py(code, build="ridgefill").stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def run_steps(model, maps, unified, tmp_path, params=PARAMS):
    out = tmp_path / f"steps-{unified}.npz"
    res = run_script(SCRIPT, {"model": str(model), "maps": str(maps), "unified": unified, "params": params,
                              "out": str(out)})
    with np.load(out) as data:
        return res, {k: data[k] for k in data.files}


@pytest.mark.parametrize("unified", [False, True], ids=["separate-kv", "unified-kv"])
def test_other_sequences_decoding_between_the_late_steps_change_no_byte_of_either(unified, llama_with_maps, tmp_path):
    require_builds("ridgefill")
    res, a = run_steps(*llama_with_maps, unified, tmp_path)
    assert res["none"]["applied"] == 1 and res["late"]["applied"] == 1
    assert res["late"]["during"] >= 4, res["late"]  # the other user got tokens while the prefill ran
    assert all(res["late"]["yields"]), res["late"]["yields"]  # a dense prefill may always yield
    assert res["late"]["exact_rows"] == res["none"]["exact_rows"] and res["late"]["exact"] > 0
    assert_same_bytes(a["late_mine"], a["none_mine"])
    assert_same_bytes(a["late_other"], a["none_other"])


@pytest.mark.parametrize("unified", [False, True], ids=["separate-kv", "unified-kv"])
def test_decoding_between_sweep_one_batches_moves_only_the_cells_order(unified, llama_with_maps, tmp_path):
    require_builds("ridgefill")
    res, a = run_steps(*llama_with_maps, unified, tmp_path)
    assert res["all"]["during"] == 8 and res["all"]["applied"] == 1
    # float noise of the summation order: up to 1.05e-4 of the range on an AVX2 EPYC (below 1e-4 where this was
    # first written); a wrong cell read moves logits by 1e-2 and more
    scale = np.abs(a["none_mine"]).max()
    assert np.abs(a["all_mine"] - a["none_mine"]).max() <= 2e-4 * scale
    assert np.abs(a["all_other"] - a["none_other"]).max() <= 2e-4 * np.abs(a["none_other"]).max()
    assert int(np.argmax(a["all_mine"])) == int(np.argmax(a["none_mine"]))


def test_a_cancelled_prefill_leaves_no_rows_and_parameters_wait_for_the_prefill_in_flight(llama_with_maps, tmp_path):
    require_builds("ridgefill")
    res, a = run_steps(*llama_with_maps, False, tmp_path)
    c = res["cancel"]
    assert c["active_during"] == 0 and c["active_after"] == -1
    assert c["pos_max_0"] == -1 and c["pos_max_1"] == 79  # seq 0's rows gone, seq 1's prompt kept
    assert_same_bytes(a["after_cancel_mine"], a["none_mine"])
    assert "in flight" in res["probe_refused"]["refused"], res["probe_refused"]


HYBRID_SCRIPT = r'''
import json, sys
import numpy as np
from ridgefill_gguf.engine.session import Session
from ridgefill_gguf.engine import bindings as B

cfg = json.loads(sys.argv[1])
S = Session(cfg["model"], n_ctx=1024, n_batch=64, n_ubatch=32, n_threads=2, maps=cfg["maps"], n_seq_max=3)
lc = S.lc
rng = np.random.default_rng(0)
mine = [int(t) for t in rng.integers(1000, 5000, 300)]
prompts = {1: [int(t) for t in rng.integers(1000, 5000, 40)], 2: [int(t) for t in rng.integers(1000, 5000, 40)]}
steps = 6

def decode_others(i):
    """one token for each of seqs 1 and 2 in one batch: the recurrent memory gathers their cells side by side"""
    batch = lc.llama_batch_init(2, 0, 1)
    for j, seq in enumerate((1, 2)):
        batch.token[j], batch.pos[j], batch.n_seq_id[j] = prompts[seq][-1] + i, len(prompts[seq]) + i, 1
        batch.seq_id[j][0], batch.logits[j] = seq, 1
    batch.n_tokens = 2
    assert lc.llama_decode(S.ctx, batch) == 0
    lc.llama_batch_free(batch)
    return np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(S.ctx, j), shape=(S.n_vocab,)).copy()
                     for j in range(2)])

def run(interleave):
    """cells: seq 1 in cell 0, this prefill's sequence 0 in cell 1, seq 2 in cell 2, so that a batch of seqs 1
    and 2 swaps seq 0's cell away; the others decode between late-layer steps (late) or only after (none)."""
    S.clear()
    S._decode(prompts[1], 0, seq=1)
    S._decode(mine[:1], 0, seq=0)
    S._decode(prompts[2], 0, seq=2)
    B.configure(S.ctx, **cfg["params"])
    others = []
    def between(may):
        stage = (B.prefill_progress(S.ctx) or ("done",))[0]
        if interleave == "late" and stage != "sweep one" and len(others) < steps:
            others.append(decode_others(len(others)))
    yields = B.prefill_between(S.ctx, mine[1:-1], between, seq=0, n_following=1)
    during = len(others)
    while len(others) < steps:
        others.append(decode_others(len(others)))
    S._decode(mine[-1:], len(mine) - 1, "last", seq=0)
    return S._last_logits(), np.stack(others), {"yields": yields, "during": during, **B.stats(S.ctx)}

arrays, res = {}, {}
for arm in ("none", "late"):
    arrays[arm + "_mine"], arrays[arm + "_other"], res[arm] = run(arm)
np.savez(cfg["out"], **arrays)
print("RESULT " + json.dumps(res))
'''


def test_a_hybrid_yields_in_its_late_layers_and_other_sequences_moving_its_recurrent_cell_change_no_byte(tmp_path):
    require_builds("ridgefill")
    model, maps = tiny_model_with_maps(tmp_path, "qwen35", n_layer=8, split=2)
    out = tmp_path / "hybrid-steps.npz"
    res = run_script(HYBRID_SCRIPT, {"model": str(model), "maps": str(maps), "params": {**PARAMS, "probe": [0, 0]},
                                     "out": str(out)})
    with np.load(out) as a:
        assert res["late"]["applied"] == 1 and all(res["late"]["yields"]), res["late"]["yields"]
        assert res["late"]["during"] == 6, res["late"]  # the others decoded while the late layers ran
        assert_same_bytes(a["late_mine"], a["none_mine"])
        assert_same_bytes(a["late_other"], a["none_other"])


PROGRESS_SCRIPT = r'''
import json, sys
import numpy as np
from ridgefill_gguf.engine.session import Session
from ridgefill_gguf.engine import bindings as B

cfg = json.loads(sys.argv[1])
S = Session(cfg["model"], n_ctx=1024, n_batch=64, n_ubatch=32, n_threads=2, maps=cfg["maps"])
mine = [int(t) for t in np.random.default_rng(0).integers(1000, 5000, 300)]
B.configure(S.ctx, **cfg["params"])
before = B.prefill_progress(S.ctx)
seen = []
gen = B.prefill_steps(S.ctx, mine[:-1], seq=0, n_following=1)
try:
    while True:
        next(gen)
        seen.append(B.prefill_progress(S.ctx))
except StopIteration as stop:
    assert stop.value is True, "RidgeFill did not apply"
print("RESULT " + json.dumps({"before": before, "seen": seen, "after": B.prefill_progress(S.ctx)}))
'''


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_a_prefill_in_flight_reports_its_stages_in_order_and_its_progress_never_goes_back(arch, tmp_path):
    require_builds("ridgefill")
    model, maps = tiny_model_with_maps(tmp_path, arch, n_layer=8 if arch == "qwen35" else 4,
                                       split=2 if arch == "qwen35" else 1)
    res = run_script(PROGRESS_SCRIPT, {"model": str(model), "maps": str(maps), "params": PARAMS})
    assert res["before"] is None and res["after"] is None  # nothing in flight before begin or after the end
    stages = [s for s, _, _ in res["seen"]]
    order = [s for i, s in enumerate(stages) if i == 0 or stages[i - 1] != s]
    assert order[0] == "sweep one" and order[-1] in ("late layers", "done"), order
    assert len(order) == len(set(order)), order  # each stage once: no stage comes back
    assert set(order) <= {"sweep one", "probe", "fill", "late layers", "done"} and "probe" in order, order
    for stage in set(stages):
        got = [(d, t) for s, d, t in res["seen"] if s == stage]
        assert all(0 <= d <= t for d, t in got) and len({t for _, t in got}) == 1, (stage, got)
        assert [d for d, _ in got] == sorted(d for d, _ in got), (stage, got)
    sweep = [(d, t) for s, d, t in res["seen"] if s == "sweep one"]
    assert sweep[0] == (64, 299)  # one batch of 64 rows done of the 299 before the last token


def test_each_chunk_of_a_hybrids_late_recurrent_layer_is_a_step_of_its_own(tmp_path):
    # so that the other slots wait for one chunk of rows through one layer, not for the layer over the whole prompt
    require_builds("ridgefill")
    model, maps = tiny_model_with_maps(tmp_path, "qwen35", n_layer=8, split=2)
    late = {}
    for rc in (0, 16):  # 0: the fill's chunk, 48 rows
        res = run_script(PROGRESS_SCRIPT, {"model": str(model), "maps": str(maps),
                                           "params": {**PARAMS, "recurrent_chunk": rc}})
        late[rc] = sum(1 for s, _, _ in res["seen"] if s == "late layers")
    # with resident maps a group of rows (a carry graph's) passes each late layer (2-7) in a step of its own, so the
    # 299 rows make 7 groups of 48 rows, or 19 of 16
    assert late == {0: 7 * 6, 16: 19 * 6}, late


@pytest.mark.parametrize("arch, probe", [("llama", True), ("llama", False), ("qwen35", True), ("qwen35", False)])
def test_each_chunk_of_a_late_attention_layers_fill_is_a_step_of_its_own(arch, probe, tmp_path):
    # the fill writes every filled row's K/V, so as one step it would grow with the prompt; in chunks the other
    # slots wait for one chunk of the fill, in the probe's pass (probe) or in the second sweep's fills (no probe)
    require_builds("ridgefill")
    model, maps = tiny_model_with_maps(tmp_path, arch, n_layer=8 if arch == "qwen35" else 4,
                                       split=2 if arch == "qwen35" else 1)
    stage = "probe" if probe else "fill"
    steps = {}
    for chunk in (48, 16):
        params = {**PARAMS, "chunk": chunk, "recurrent_chunk": 48, "probe": PARAMS["probe"] if probe else [0, 0]}
        res = run_script(PROGRESS_SCRIPT, {"model": str(model), "maps": str(maps), "params": params})
        steps[chunk] = sum(1 for s, _, _ in res["seen"] if s == stage)
    # 258-259 filled rows (the prefix of 259 but position 0; a hybrid's probe fills all 259) take 17 chunks of 16
    # rows instead of 6 of 48 in each late attention layer: 1, 2 and 3 of the llama, 3 and 7 of the qwen35
    n_attention = 3 if arch == "llama" else 2
    assert steps[16] - steps[48] == n_attention * (17 - 6), steps
