"""The engine's RidgeFill prefill on a hybrid of attention and Gated DeltaNet layers (qwen35; qwen3next at the end)
climbs the correctness ladder on the CPU: off is byte-identical to upstream, plumb and oracle give stock's bytes (decode steps included),
resident and streamed maps agree to the byte, and the filled arms, the exact rows, the probe and the value rescale
match the NumPy specification of the hybrid arm (reference_hybrid_ridgefill), whose wrong variants (states carried
in the wrong order, exact rows fed their prediction, the probe's states kept) miss by 1e-1 or more
(test_reference_hybrid_ridgefill.py)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conftest import assert_bytes_differ, assert_same_bytes, require_builds, run_py
from ridgefill_gguf import equivalence as eq
from ridgefill_gguf.gguf_io import read_gguf, tensor_f32
from ridgefill_gguf.maps.convert import convert
from ridgefill_gguf.maps.synthetic import write_float_file
from ridgefill_gguf.random_gguf import tiny_shape, write_random_model
from ridgefill_gguf.reference_hybrid import HybridReference
from ridgefill_gguf.reference_hybrid_ridgefill import hybrid_probe_scores, hybrid_ridgefill_forward, stock_forward
from test_engine_prefill import TIGHT, run_engine
from test_reference_hybrid import long_memory_copy

SPLIT, TAIL, N_LAYER = 2, 24, 8
TOLERANCE = 2e-5  # max |engine - NumPy| / max |NumPy|; the stock forward itself agrees to about 8e-6


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """8 layers: DeltaNet 0-2, attention 3, DeltaNet 4-6, attention 7, with slow decay so the states remember;
    split 2, so a DeltaNet layer sits at the split and both kinds are late; F32 maps for layers 3-7."""
    return slow_decay_hybrid(tmp_path_factory.mktemp("engine-hybrid"), "qwen35", seed=3, tokens_seed=0)


def slow_decay_hybrid(d, arch: str, seed: int, tokens_seed: int, n_tokens: int = 100, **fields):
    """(model, F32 maps for layers S+1.., their matrices, the NumPy reference, n_tokens tokens) for an N_LAYER-layer
    random model of `arch` (shape fields as given) whose states remember (long_memory_copy)."""
    shape = dataclasses.replace(tiny_shape(arch), n_layer=N_LAYER, **fields)
    model = long_memory_copy(write_random_model(d / "stock.gguf", shape, seed=seed), d / f"{arch}.gguf")
    src = write_float_file(d / "maps.safetensors", SPLIT, list(range(SPLIT + 1, N_LAYER)), shape.n_embd,
                           dtype="f32", seed=seed + 1)
    maps = convert(src, d / "maps.gguf", model=model, outtype="f32").out
    g = read_gguf(maps)
    mats = {l: (tensor_f32(g, f"blk.{l}.rf_map.weight"), tensor_f32(g, f"blk.{l}.rf_map.bias"))
            for l in range(SPLIT + 1, N_LAYER)}
    tokens = [int(t) for t in np.random.default_rng(tokens_seed).integers(1000, 5000, n_tokens)]
    return model, maps, mats, HybridReference(model), tokens


def numpy_ranked(ref, tokens, tail: int, mats, n_probe: int, count: int) -> list[int]:
    """The prefix rows (position 0 aside) NumPy's probe ranks highest, in position order."""
    scores = hybrid_probe_scores(ref, tokens, SPLIT, tail, n_probe, mats)
    return sorted(sorted(range(1, len(tokens) - tail), key=lambda r: (-scores[r], r))[:count])


def rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def base(chunk: int = 48, **kw) -> dict:
    return {"fill": "ridge", "tail": TAIL, "chunk": chunk, "min_prefix": 0, "exact_rows": [], **kw}


def test_ridgefill_off_with_maps_attached_is_byte_identical_to_upstream_on_a_hybrid(hybrid):
    require_builds()
    model, maps = hybrid[0], hybrid[1]
    text = "A hybrid model carries a recurrent state beside its attention cache. " * 8
    report = eq.check(model, [text, "short prompt"], n_ctx=512, decode_steps=3, maps=maps,
                      cases=[eq.Case(64, 32, False), eq.Case(64, 27, True), eq.Case(512, 512, True)])
    assert report["n_arrays"] == 18
    assert report["identical"], [r for r in report["arrays"] if not r["identical"]]


@pytest.mark.parametrize("chunk", [48, 7])
def test_the_filled_arms_and_exact_rows_match_the_numpy_hybrid_arm_in_chunks_of_any_size(chunk, hybrid, tmp_path):
    require_builds("ridgefill")
    model, maps, mats, ref, tokens = hybrid
    exact_rows = [5, 17, 40]
    runs = [{"name": "ridge", "rows": TAIL, "params": base(chunk)},
            {"name": "identity", "rows": TAIL, "params": {"fill": "identity"}},
            {"name": "rows", "rows": TAIL, "params": {"fill": "ridge", "exact_rows": exact_rows}}]
    arrays, stats = run_engine(model, maps, runs, session=TIGHT, tokens=tokens, tmp_path=tmp_path)
    want = {"ridge": hybrid_ridgefill_forward(ref, tokens, SPLIT, TAIL, "ridge", mats)[0],
            "identity": hybrid_ridgefill_forward(ref, tokens, SPLIT, TAIL, "identity")[0],
            "rows": hybrid_ridgefill_forward(ref, tokens, SPLIT, TAIL, "ridge", mats, exact_rows=exact_rows)[0]}
    for name, expected in want.items():
        err = rel(arrays[name], expected)
        print(f"chunk {chunk} {name}: rel {err:.2e}, {stats[name]['n_filled']} filled, {stats[name]['n_exact']} exact")
        assert stats[name]["applied"] == 1 and err < TOLERANCE, (name, err)
    assert stats["ridge"]["n_filled"] == len(tokens) - TAIL - 1  # position 0 runs exactly
    # resident and streamed maps alike run the late layers group by group, timed as a whole (a wait per recurrent
    # step would cost the device its queue); the layer-major order (here the rescale) times the recurrent layers'
    # part on its own
    assert all(stats[k]["t_recurrent_ms"] == 0 < stats[k]["t_exact_ms"] for k in want), stats
    streamed_runs = [{"name": "streamed", "rows": TAIL, "params": base(chunk)},
                     {"name": "rescale", "rows": TAIL, "params": base(chunk, rescale=[16, True, False])}]
    _, other = run_engine(model, maps, streamed_runs, session={**TIGHT, "placement": "streamed"}, tokens=tokens,
                          tmp_path=tmp_path)
    assert other["streamed"]["t_recurrent_ms"] == 0 < other["streamed"]["t_exact_ms"], other
    assert 0 < other["rescale"]["t_recurrent_ms"] <= other["rescale"]["t_exact_ms"], other
    assert stats["rows"]["n_exact"] == stats["ridge"]["n_exact"] + len(exact_rows)
    assert rel(arrays["ridge"], arrays["identity"]) > 1e-2  # the maps act


@pytest.mark.parametrize("flash_attn", [False, True])
def test_plumb_oracle_and_nothing_filled_give_stock_bytes_on_a_hybrid_and_decoding_continues_their_states(flash_attn, hybrid,
                                                                                          tmp_path):
    # the prompt's last token goes through llama_decode, reading every late layer's carried state
    require_builds("ridgefill")
    model, maps, _, ref, tokens = hybrid
    runs = [{"name": "stock", "stock": True}, {"name": "plumb", "params": base(fill="plumb")},
            {"name": "oracle", "params": base(fill="oracle")},
            {"name": "nothing_filled", "params": base(tail=100000)},
            {"name": "stock_rows", "stock": True, "rows": TAIL},
            {"name": "plumb_rows", "rows": TAIL, "params": base(fill="plumb")}]
    session = {"flash_attn": flash_attn, "f32_cache": True}
    arrays, stats = run_engine(model, maps, runs, session=session, tokens=tokens, tmp_path=tmp_path)
    assert stats["plumb"]["applied"] == 1 and stats["oracle"]["applied"] == 1
    assert_same_bytes(arrays["plumb"], arrays["stock"])
    assert_same_bytes(arrays["oracle"], arrays["stock"])
    assert stats["nothing_filled"]["applied"] == 1 and stats["nothing_filled"]["n_filled"] == 0
    assert_same_bytes(arrays["nothing_filled"], arrays["stock"])
    assert_same_bytes(arrays["plumb_rows"], arrays["stock_rows"])
    if not flash_attn:  # flash attention's F16 internals put llama.cpp itself 4e-4 from NumPy
        assert rel(arrays["stock_rows"], stock_forward(ref, tokens)[0][-TAIL:]) < TOLERANCE


def test_the_probe_on_a_hybrid_keeps_the_rows_numpy_ranks_highest_and_its_states_stay_apart(hybrid, tmp_path):
    # if the probe's states leaked into the second sweep, the tail's logits would miss the NumPy arm run with
    # the same exact rows
    require_builds("ridgefill")
    model, maps, mats, ref, tokens = hybrid
    n_probe, count = 8, 10
    runs = [{"name": "probe", "params": base(probe=[n_probe, count])},
            {"name": "probe_rows", "rows": TAIL, "params": base(probe=[n_probe, count])}]
    arrays, stats = run_engine(model, maps, runs, session=TIGHT, tokens=tokens, tmp_path=tmp_path)
    # the first run prefills all but the last token, which counts as tail: its probe rows end one row earlier
    ranked = numpy_ranked(ref, tokens[:-1], TAIL - 1, mats, n_probe, count)
    got = [r for r in stats["probe"]["exact_rows"] if r != 0]
    print(f"engine {got}\nnumpy  {ranked}")
    assert stats["probe"]["n_probe_exact"] == count and got == ranked
    ranked = numpy_ranked(ref, tokens, TAIL, mats, n_probe, count)
    expected = hybrid_ridgefill_forward(ref, tokens, SPLIT, TAIL, "ridge", mats, exact_rows=ranked)[0]
    err = rel(arrays["probe_rows"], expected)
    print(f"probe's tail logits: rel {err:.2e}")
    assert err < TOLERANCE


def test_the_value_rescale_on_a_hybrid_matches_numpy(hybrid, tmp_path):
    require_builds("ridgefill")
    model, maps, mats, ref, tokens = hybrid
    c = 16
    runs = [{"name": "plain", "rows": TAIL, "params": base(rescale=[0, False, False])},
            {"name": "values", "rows": TAIL, "params": base(rescale=[c, True, False])}]
    arrays, _ = run_engine(model, maps, runs, session=TIGHT, tokens=tokens, tmp_path=tmp_path)
    expected = hybrid_ridgefill_forward(ref, tokens, SPLIT, TAIL, "ridge", mats, rescale_rows=c,
                                        rescale_values=True)[0]
    err = rel(arrays["values"], expected)
    print(f"value rescale: rel {err:.2e}; it moves the logits by {rel(arrays['values'], arrays['plain']):.2e}")
    assert err < TOLERANCE
    assert rel(arrays["values"], arrays["plain"]) > 1e-4


def test_resident_and_streamed_maps_give_byte_identical_logits_on_a_hybrid(hybrid, tmp_path):
    require_builds("ridgefill")
    model, maps, _, _, tokens = hybrid
    runs = [{"name": "ridge", "params": base()}, {"name": "probe", "params": base(probe=[8, 10])},
            {"name": "rescale", "params": base(rescale=[16, True, False])}]
    out = {}
    for placement in ("resident", "streamed"):
        arrays, _ = run_engine(model, maps, runs, session={"placement": placement}, tokens=tokens,
                               tmp_path=tmp_path)
        out[placement] = arrays
    for run in runs:
        assert_same_bytes(out["resident"][run["name"]], out["streamed"][run["name"]], run["name"])


def test_the_carrys_chunk_moves_the_logits_only_by_float_rounding_on_a_hybrid(hybrid, tmp_path):
    # the states and the conv window carry from one chunk to the next exactly; only the products' rounding follows
    # the number of rows per graph. 0 is the fill's chunk, 48 here
    require_builds("ridgefill")
    model, maps, _, _, tokens = hybrid
    arms = {"ridge": {}, "exact rows": {"exact_rows": [5, 30, 31, 60]}, "probe": {"probe": [8, 10]}}
    runs = [{"name": f"{arm}|{rc}", "params": {**base(**kw), "recurrent_chunk": rc}}
            for arm, kw in arms.items() for rc in (0, 48, 1, 7, 100)]
    arrays, stats = run_engine(model, maps, runs, tokens=tokens, tmp_path=tmp_path)
    for arm in arms:
        assert stats[f"{arm}|0"]["n_filled"] > 0
        assert_same_bytes(arrays[f"{arm}|48"], arrays[f"{arm}|0"], arm)
        for rc in (1, 7, 100):
            assert rel(arrays[f"{arm}|{rc}"], arrays[f"{arm}|0"]) <= 1e-5, (arm, rc)


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_upstreams_chunked_state_update_follows_the_numpy_hybrid_arm_and_the_fused_op_to_float_rounding(arch, request,
                                                                                                  tmp_path):
    # the chunked graph pads a graph's rows to blocks of 64: carry graphs of 48 and 7 rows leave a padded block in
    # every graph. The default asks the fused op for its blocked form, which only CUDA has (test_gpu_hybrid.py):
    # on the CPU it is the fused op's row walk, llama_decode's, byte for byte
    require_builds("ridgefill")
    model, maps, mats, ref, tokens = request.getfixturevalue("hybrid" if arch == "qwen35" else "next_hybrid")
    exact_rows, n_probe, count = [5, 17, 40], 8, 10
    arms = {"ridge": {}, "rows": {"exact_rows": exact_rows}, "probe_rows": {"probe": [n_probe, count]}}
    runs = [{"name": "default", "rows": TAIL, "params": base()}]
    runs += [{"name": f"{arm}|{update}|{rc}", "rows": TAIL,
              "params": {**base(**kw), "state_update": update, "recurrent_chunk": rc}}
             for arm, kw in arms.items() for update, rc in (("fused", 0), ("blocked", 0), ("chunked", 0), ("chunked", 7))]
    arrays, stats = run_engine(model, maps, runs, session=TIGHT, tokens=tokens, tmp_path=tmp_path)
    ranked = numpy_ranked(ref, tokens, TAIL, mats, n_probe, count)
    arm = lambda **kw: hybrid_ridgefill_forward(ref, tokens, SPLIT, TAIL, "ridge", mats, **kw)[0]  # noqa: E731
    want = {"ridge": arm(), "rows": arm(exact_rows=exact_rows), "probe_rows": arm(exact_rows=ranked)}
    for name, expected in want.items():
        fused = arrays[f"{name}|fused|0"]
        for rc in (0, 7):
            chunked = arrays[f"{name}|chunked|{rc}"]
            err, moved = rel(chunked, expected), rel(chunked, fused)
            print(f"{arch} {name} chunked, carry graphs of {rc or 48} rows: rel {err:.2e} against NumPy, "
                  f"{moved:.2e} from the fused op")
            assert stats[f"{name}|chunked|{rc}"]["n_filled"] > 0
            assert err < TOLERANCE and moved <= 1e-5, (name, rc, err, moved)
            assert_bytes_differ(chunked, fused, (name, rc))  # the other graph ran
        assert_same_bytes(arrays[f"{name}|blocked|0"], fused, name)
    assert_same_bytes(arrays["default"], arrays["ridge|blocked|0"])


@pytest.fixture(scope="module")
def corrected(hybrid, tmp_path_factory):
    """The hybrid's maps with random terminal-state offsets for the late DeltaNet layers 4-6 (not the split's)."""
    from ridgefill_gguf.maps.state_delta import write_state_deltas

    model, maps, _, ref, _ = hybrid
    hp, rng = ref.hp, np.random.default_rng(9)
    deltas = {il: rng.normal(0, 0.5, (hp.n_v_heads, hp.head_v_dim, hp.head_k_dim)).astype(np.float32)
              for il in (4, 5, 6)}
    return write_state_deltas(maps, deltas, tmp_path_factory.mktemp("corrected") / "maps.gguf"), deltas


def test_the_terminal_state_correction_matches_numpy_and_is_off_by_default(hybrid, corrected, tmp_path):
    require_builds("ridgefill")
    model, maps, mats, ref, tokens = hybrid
    with_deltas, deltas = corrected
    runs = [{"name": "off", "rows": TAIL, "params": base()},
            {"name": "on", "rows": TAIL, "params": base(state_correction=True)},
            {"name": "rows", "rows": TAIL, "params": base(state_correction=True, exact_rows=[5, 17, 40])}]
    arrays, stats = run_engine(model, with_deltas, runs, session=TIGHT, tokens=tokens, tmp_path=tmp_path)
    plain, _ = run_engine(model, maps, runs[:1], session=TIGHT, tokens=tokens, tmp_path=tmp_path)
    assert_same_bytes(arrays["off"], plain["off"])  # offsets in the file change nothing while off
    assert stats["off"]["n_state_corrected"] == 0 and stats["on"]["n_state_corrected"] == 3
    for name, rows in (("on", ()), ("rows", (5, 17, 40))):
        want, info = hybrid_ridgefill_forward(ref, tokens, SPLIT, TAIL, "ridge", mats, exact_rows=rows,
                                              state_deltas={il: d.astype(np.float64) for il, d in deltas.items()})
        err = rel(arrays[name], want)
        print(f"{name}: rel {err:.2e} against NumPy, rho {info['rho'][4].round(3)}; "
              f"the correction moves the logits by {rel(arrays[name], arrays['off']):.2e}")
        assert err < TOLERANCE
    assert rel(arrays["on"], arrays["off"]) > 1e-3


def test_the_filled_share_is_the_weight_of_the_filled_rows_under_the_gates_after_them():
    from ridgefill_gguf.reference_hybrid_ridgefill import HybridRidgeFill

    rng = np.random.default_rng(0)
    ld = -rng.uniform(0.0, 0.3, (12, 3))  # log gates of 12 rows, 3 value heads
    filled = np.array([False, True, True, False, True, True, True, False, True, False, False, False])
    w = np.array([[np.exp(ld[j + 1:, h].sum()) for h in range(3)] for j in range(12)])
    np.testing.assert_allclose(HybridRidgeFill.filled_share(ld, filled), w[filled].sum(0) / w.sum(0), rtol=1e-12)
    assert (w[-1] == 1).all()  # the last prefix row's weight


def test_a_state_offset_for_an_attention_layer_is_refused_by_name(hybrid, tmp_path):
    from ridgefill_gguf.maps.format import check_maps, model_fingerprint
    from ridgefill_gguf.maps.state_delta import write_state_deltas

    model, maps, _, ref, _ = hybrid
    hp = ref.hp
    bad = write_state_deltas(maps, {3: np.zeros((hp.n_v_heads, hp.head_v_dim, hp.head_k_dim), np.float32)},
                             tmp_path / "bad.gguf")
    errors = check_maps(read_gguf(bad), model_fingerprint(model)).errors
    assert errors == ["tensor blk.3.rf_state_delta is for layer 3, which is not a recurrent layer at or after the split"]
    require_builds("ridgefill")
    out = run_py(f"""
from ridgefill_gguf import libs
from ridgefill_gguf.engine import bindings
llama_cpp = libs.use_build("ridgefill")
llm = llama_cpp.Llama(model_path={str(model)!r}, n_ctx=64, verbose=False)
try:
    bindings.load_maps(llm.model, {str(bad)!r})
except bindings.MapsRefused as e:
    print("REFUSED", e)
""").stdout
    assert "REFUSED" in out and "blk.3.rf_state_delta is for layer 3, which is not a recurrent layer" in out


def test_the_probes_states_stay_out_of_a_continued_sequence(hybrid):
    # a continued sequence keeps its late states (no clearing before the second sweep): had the probe's pass
    # written its states back, the probe's prefill would differ from one given the probe's rows as exact rows
    require_builds("ridgefill")
    model, maps, _, _, tokens = hybrid
    code = f"""
import json
import numpy as np
from ridgefill_gguf import libs
from ridgefill_gguf.engine.session import Session
libs.use_build("ridgefill")
s = Session({str(model)!r}, n_ctx=512, n_batch=64, n_ubatch=32, n_threads=2, f32_cache=True, maps={str(maps)!r})
b = s.bindings
first, rest = {tokens!r}[:30], {tokens!r}[30:]
def run(**params):
    b.configure(s.ctx, tail={TAIL}, chunk=48, min_prefix=0, **params)
    s.clear()
    s._stock_prefix(first)
    assert b.prefill(s.ctx, rest[:-1], n_following=1), b.not_applied_reason()
    rows = b.exact_rows(s.ctx)
    s._decode(rest[-1:], len(first) + len(rest) - 1, "last")
    return s._last_logits(), rows
probe, rows = run(probe=(8, 10))
given, same = run(probe=(0, 0), exact_rows=rows)
print(json.dumps({{"rows": rows, "same": same, "identical": probe.tobytes() == given.tobytes()}}))
"""
    out = json.loads(run_py(code, "ridgefill").stdout.strip().splitlines()[-1])
    assert len(out["rows"]) == 10 and out["same"] == out["rows"]
    assert out["identical"]


# -- qwen3next: the same schedule through its own adapter (a mixture of experts, beta and alpha in one projection,
# grouped value heads, plain RoPE), and the same NumPy arm over its own stock reference


@pytest.fixture(scope="module")
def next_hybrid(tmp_path_factory):
    return slow_decay_hybrid(tmp_path_factory.mktemp("engine-qwen3next"), "qwen3next", seed=5, tokens_seed=1)


def test_qwen3next_off_is_byte_identical_to_upstream_and_plumb_oracle_and_nothing_filled_to_stock(next_hybrid,
                                                                                                 tmp_path):
    require_builds()
    model, maps, _, _, tokens = next_hybrid
    text = "A hybrid of experts carries a recurrent state beside its attention cache. " * 8
    report = eq.check(model, [text], n_ctx=512, decode_steps=3, maps=maps,
                      cases=[eq.Case(64, 32, False), eq.Case(64, 27, True)])
    assert report["identical"], [r for r in report["arrays"] if not r["identical"]]
    runs = [{"name": "stock", "stock": True}, {"name": "plumb", "params": base(fill="plumb")},
            {"name": "oracle", "params": base(fill="oracle")},
            {"name": "nothing_filled", "params": base(tail=100000)}]
    arrays, stats = run_engine(model, maps, runs, session=TIGHT, tokens=tokens, tmp_path=tmp_path)
    for name in ("plumb", "oracle", "nothing_filled"):
        assert stats[name]["applied"] == 1
        assert_same_bytes(arrays[name], arrays["stock"], name)


def test_qwen3next_fills_probes_rescales_and_corrects_with_resident_and_streamed_maps_alike(next_hybrid, tmp_path):
    from ridgefill_gguf.maps.state_delta import write_state_deltas

    require_builds("ridgefill")
    model, maps, _, _, tokens = next_hybrid
    shape = dataclasses.replace(tiny_shape("qwen3next"), n_layer=N_LAYER)
    state = shape.recurrent_state_shape
    corrected = write_state_deltas(maps, {il: np.full(state, 0.05, np.float32) for il in (4, 5, 6)},
                                   tmp_path / "corrected.gguf")
    runs = [{"name": "stock", "stock": True}, {"name": "ridge", "params": base()},
            {"name": "identity", "params": base(fill="identity")},
            {"name": "probe", "params": base(probe=[8, 10])},
            {"name": "rescale", "params": base(rescale=[16, True, False])},
            {"name": "corrected", "params": base(state_correction=True)}]
    out = {}
    for placement in ("resident", "streamed"):
        out[placement] = run_engine(model, corrected, runs, session={"placement": placement}, tokens=tokens,
                                    tmp_path=tmp_path)
    arrays, stats = out["resident"]
    for run in runs:
        assert_same_bytes(out["resident"][0][run["name"]], out["streamed"][0][run["name"]], run["name"])
        assert np.isfinite(arrays[run["name"]]).all()
    for a, b in (("ridge", "identity"), ("ridge", "probe"), ("ridge", "rescale"), ("ridge", "corrected"),
                 ("stock", "ridge")):
        assert np.abs(arrays[a] - arrays[b]).max() > 1e-4, (a, b)
    assert stats["probe"]["n_probe_exact"] == 10 and stats["corrected"]["n_state_corrected"] == 3


def test_qwen3next_s_fill_exact_rows_probe_rescale_and_correction_match_the_numpy_hybrid_arm(next_hybrid, tmp_path):
    from ridgefill_gguf.maps.state_delta import write_state_deltas

    require_builds("ridgefill")
    model, maps, mats, ref, tokens = next_hybrid
    hp, rng = ref.hp, np.random.default_rng(10)
    deltas = {il: rng.normal(0, 0.5, (hp.n_v_heads, hp.head_v_dim, hp.head_k_dim)).astype(np.float32)
              for il in (4, 5, 6)}
    corrected = write_state_deltas(maps, deltas, tmp_path / "corrected.gguf")
    exact_rows, n_probe, count, c = [5, 17, 40], 8, 10, 16
    # a run's parameters stay set for the runs after it
    runs = [{"name": "ridge", "rows": TAIL, "params": base()},
            {"name": "rows", "rows": TAIL, "params": base(exact_rows=exact_rows)},
            {"name": "corrected", "rows": TAIL, "params": base(state_correction=True)},
            {"name": "rescale", "rows": TAIL, "params": base(rescale=[c, True, False], state_correction=False)},
            {"name": "probe", "params": base(probe=[n_probe, count], rescale=[0, False, False])},
            {"name": "probe_rows", "rows": TAIL, "params": base(probe=[n_probe, count], rescale=[0, False, False])}]
    arrays, stats = run_engine(model, corrected, runs, session=TIGHT, tokens=tokens, tmp_path=tmp_path)
    # the probe's run prefills all but the last token, which counts as tail: its probe rows end one row earlier
    ranked = numpy_ranked(ref, tokens[:-1], TAIL - 1, mats, n_probe, count)
    assert [r for r in stats["probe"]["exact_rows"] if r != 0] == ranked
    ranked = numpy_ranked(ref, tokens, TAIL, mats, n_probe, count)
    arm = lambda **kw: hybrid_ridgefill_forward(ref, tokens, SPLIT, TAIL, "ridge", mats, **kw)[0]  # noqa: E731
    want = {"ridge": arm(), "rows": arm(exact_rows=exact_rows), "rescale": arm(rescale_rows=c, rescale_values=True),
            "corrected": arm(state_deltas={il: d.astype(np.float64) for il, d in deltas.items()}),
            "probe_rows": arm(exact_rows=ranked)}
    for name, expected in want.items():
        err = rel(arrays[name], expected)
        print(f"qwen3next {name}: rel {err:.2e} against NumPy, {rel(arrays[name], want['ridge']):.2e} from ridge")
        assert err < TOLERANCE, (name, err)
        assert name == "ridge" or rel(arrays[name], want["ridge"]) > 1e-4, name  # each arm moves the logits
    assert stats["corrected"]["n_state_corrected"] == 3 and stats["rows"]["n_exact"] == stats["ridge"]["n_exact"] + 3


def test_a_sequence_beyond_the_recurrent_memory_is_refused_by_name(hybrid):
    require_builds("ridgefill")
    model, maps, _, _, tokens = hybrid
    code = f"""
from ridgefill_gguf import libs
from ridgefill_gguf.engine.session import Session
libs.use_build("ridgefill")
s = Session({str(model)!r}, n_ctx=512, n_batch=64, n_ubatch=32, n_threads=2, maps={str(maps)!r})
s.bindings.configure(s.ctx, tail={TAIL}, min_prefix=0)
print("APPLIED", s.bindings.prefill(s.ctx, {tokens!r}, seq=3), s.bindings.not_applied_reason())
"""
    out = run_py(code, "ridgefill").stdout
    assert "APPLIED False sequence 3 is beyond the recurrent memory's 1 sequences" in out, out[-2000:]
