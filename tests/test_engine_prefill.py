"""The engine's RidgeFill prefill climbs the correctness ladder (design brief §4) on the CPU.

Rung 1: RidgeFill off with maps attached is byte-identical to upstream. Rung 2: resident and streamed maps give
the same bytes. Rung 3: plumb, oracle and a prefill with nothing filled reproduce stock. Rung 4: an independent
NumPy computation of the ridge arm from the GGUF's weights agrees with the engine.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, assert_same_bytes, require_builds
from ridgefill_gguf import equivalence as eq
from ridgefill_gguf.gguf_io import read_gguf, tensor_f32
from ridgefill_gguf.maps.convert import convert
from ridgefill_gguf.maps.synthetic import write_float_file
from ridgefill_gguf.random_gguf import tiny_shape, write_random_model
from ridgefill_gguf.reference import ReferenceModel

ARCHS = ["llama", "qwen2", "qwen3"]
SPLIT = 1
TEXT = ("RidgeFill predicts the input of every late layer from the split layer's state, and the layer only "
        "writes its cache from that prediction; the tail runs the whole model over that cache. ") * 6


@pytest.fixture(scope="module")
def deep_tiny(tmp_path_factory):
    """Per architecture: a 4-layer random F32 model and F32 maps for layers 2 and 3 at split 1."""
    d = tmp_path_factory.mktemp("engine-prefill")
    out = {}
    for arch in ARCHS:
        shape = dataclasses.replace(tiny_shape(arch), n_layer=4)
        model = write_random_model(d / f"{arch}.gguf", shape, seed=3)
        src = write_float_file(d / f"{arch}.safetensors", SPLIT, [2, 3], shape.n_embd, dtype="f32", seed=4)
        maps = convert(src, d / f"{arch}.maps.gguf", model=model, outtype="f32").out
        out[arch] = (model, maps)
    return out


def run_engine(model, maps, runs, *, session=None, build="ridgefill", prompt=TEXT, tokens=None, special=False,
               n_ctx=512, tmp_path=None, pieces=False, env=None):
    spec = {"model": str(model), "n_ctx": n_ctx, "runs": runs, "special": special, "pieces": pieces,
            "session": {"n_batch": 64, "n_ubatch": 32, "n_threads": 2, "maps": str(maps) if maps else None,
                        **(session or {})}}
    if tokens:
        spec["tokens"] = tokens
    else:
        spec["prompt"] = prompt
    spec_file, out = tmp_path / "spec.json", tmp_path / "out.npz"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "ridgefill_gguf.engine.session", "--build", build,
                           "--spec", str(spec_file), "-o", str(out)], cwd=ROOT, text=True,
                          env=dict(os.environ, PYTHONFAULTHANDLER="1", **(env or {})), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    with np.load(out) as data:
        arrays = {k: data[k] for k in data.files}
    return arrays, json.loads(out.with_suffix(".json").read_text())


# the configuration in which llama.cpp and the NumPy reference agree to about 1e-6 (design brief §4, rung 4)
TIGHT = {"f32_cache": True, "flash_attn": False}


def reference_and_maps(model, maps):
    g = read_gguf(maps)
    layers = [int(name.split(".")[1]) for name in g.tensors if name.endswith("rf_map.weight")]
    return ReferenceModel(model), {l: (tensor_f32(g, f"blk.{l}.rf_map.weight"), tensor_f32(g, f"blk.{l}.rf_map.bias"))
                                   for l in layers}


def reference_arms(model, maps, tokens, split, tail, exact_rows) -> dict[str, np.ndarray]:
    """The NumPy reference's last logits for the runs ridge, identity and ridge_rows (ridge with exact_rows)."""
    ref, mats = reference_and_maps(model, maps)
    return {"ridge": ref.ridgefill_forward(tokens, split, tail, "ridge", mats)[-1],
            "identity": ref.ridgefill_forward(tokens, split, tail, "identity")[-1],
            "ridge_rows": ref.ridgefill_forward(tokens, split, tail, "ridge", mats, set(exact_rows))[-1]}


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    lp = p_logits - np.logaddexp.reduce(p_logits.astype(np.float64))
    lq = q_logits - np.logaddexp.reduce(q_logits.astype(np.float64))
    return float(np.sum(np.exp(lp) * (lp - lq)))


def test_ridgefill_off_with_maps_attached_is_byte_identical_to_upstream(deep_tiny):
    require_builds()
    model, maps = deep_tiny["qwen3"]
    report = eq.check(model, [TEXT, "short prompt"], n_ctx=512, decode_steps=3, maps=maps,
                      cases=[eq.Case(64, 32, False), eq.Case(512, 512, True)])
    assert report["maps"] == str(maps)
    assert report["n_arrays"] == 12
    assert report["identical"], [r for r in report["arrays"] if not r["identical"]]


@pytest.mark.parametrize("flash_attn", [False, True])
def test_a_stock_prefill_after_ridgefill_prefills_gives_the_bytes_of_one_before_them(flash_attn, deep_tiny, tmp_path):
    # RidgeFill's graphs take over the scheduler's reservation and give the stock one back (patch 0018)
    require_builds("ridgefill")
    model, maps = deep_tiny["qwen3"]
    base = {"fill": "ridge", "tail": 40, "chunk": 48, "min_prefix": 0}
    runs = [{"name": "before", "stock": True}, {"name": "ridge", "params": base},
            {"name": "probe", "params": {**base, "probe": [16, 8]}}, {"name": "after", "stock": True}]
    arrays, stats = run_engine(model, maps, runs, session={"flash_attn": flash_attn}, tmp_path=tmp_path)
    assert stats["ridge"]["applied"] == 1 and stats["probe"]["applied"] == 1
    assert_same_bytes(arrays["before"], arrays["after"])


@pytest.mark.parametrize("arch", ARCHS)
def test_the_ridge_arm_matches_an_independent_numpy_computation(arch, deep_tiny, tmp_path):
    require_builds("ridgefill")
    model, maps = deep_tiny[arch]
    tail, exact_rows = 40, [10, 57]
    runs = [{"name": "ridge", "params": {"fill": "ridge", "tail": tail, "chunk": 48, "min_prefix": 0,
                                         "exact_rows": []}},
            {"name": "identity", "params": {"fill": "identity"}},
            {"name": "ridge_rows", "params": {"fill": "ridge", "exact_rows": exact_rows}}]
    arrays, stats = run_engine(model, maps, runs, session=TIGHT, tmp_path=tmp_path)
    want = reference_arms(model, maps, arrays["tokens"].tolist(), SPLIT, tail, exact_rows)
    for name, expected in want.items():
        got = arrays[name]
        rel = np.abs(got - expected).max() / np.abs(expected).max()
        print(f"{arch} {name}: rel {rel:.2e}, stats {stats[name]}")
        assert stats[name]["applied"] == 1 and stats[name]["t_recurrent_ms"] == 0  # no recurrent layers
        assert rel < 2e-5, (name, rel)
    assert stats["ridge_rows"]["n_exact"] == stats["ridge"]["n_exact"] + 2
    # the maps are applied: ridge and identity are far apart where the model is this sensitive
    assert np.abs(arrays["ridge"] - arrays["identity"]).max() > 1e-3


SELECTOR_TAIL = 40


def run_selector(arch, deep_tiny, tmp_path, params: dict, scores, session=TIGHT, tolerance=2e-5):
    """Run one selector on the ridge arm; check that it chose the rows NumPy ranks highest (scores(ref, mats,
    prompt) gives per-row scores and the count) and that the prefill with them matches NumPy. Returns the stats."""
    model, maps = deep_tiny[arch]
    runs = [{"name": "sel", "params": {"fill": "ridge", "tail": SELECTOR_TAIL, "chunk": 48, "min_prefix": 0,
                                       "exact_rows": [], **params}}]
    arrays, stats = run_engine(model, maps, runs, session=session, tmp_path=tmp_path)
    tokens = arrays["tokens"].tolist()
    ref, mats = reference_and_maps(model, maps)
    # the engine prefills all but the last token (which follows through llama_decode and counts as tail)
    score, count = scores(ref, mats, tokens[:-1])
    ranked = sorted(range(1, len(tokens) - SELECTOR_TAIL), key=lambda r: -score[r])
    chosen = sorted(ranked[:count])
    st = stats["sel"]
    print(f"{arch}: engine {st['exact_rows']}, numpy {[0] + chosen}; margin {score[ranked[count - 1]] - score[ranked[count]]:.3g}")
    assert st["applied"] == 1 and count > 0 and st["exact_rows"] == [0] + chosen
    expected = ref.ridgefill_forward(tokens, SPLIT, SELECTOR_TAIL, "ridge", mats, set(chosen))[-1]
    assert np.abs(arrays["sel"] - expected).max() / np.abs(expected).max() < tolerance
    return st


@pytest.mark.parametrize("arch", ARCHS)
def test_the_probe_makes_exact_the_rows_the_last_rows_attend_to_most_as_numpy_ranks_them(arch, deep_tiny, tmp_path):
    require_builds("ridgefill")
    n_probe, n_exact = 16, 8
    st = run_selector(arch, deep_tiny, tmp_path, {"probe": [n_probe, n_exact]},
                      lambda ref, mats, prompt: (ref.probe_scores(prompt, SPLIT, SELECTOR_TAIL - 1, n_probe, mats),
                                                 n_exact))
    assert st["n_probe"] == n_probe and st["n_probe_exact"] == n_exact


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_probe_over_known_exact_rows_of_several_chunks_ranks_and_fills_as_numpy(arch, deep_tiny, tmp_path):
    # the listed rows run exactly in the probe's pass before its rows: three chunks of 32 (flash attention off, a
    # ubatch) through every late layer in turn, their inputs in a ring of one chunk's rows
    require_builds("ridgefill")
    n_probe, n_exact = 16, 8
    model, maps = deep_tiny[arch]
    listed = list(range(3, 3 + 2 * 70, 2))
    runs = [{"name": "sel", "params": {"fill": "ridge", "tail": SELECTOR_TAIL, "chunk": 48, "min_prefix": 0,
                                       "exact_rows": listed, "probe": [n_probe, n_exact]}}]
    arrays, stats = run_engine(model, maps, runs, session=TIGHT, tmp_path=tmp_path)
    tokens = arrays["tokens"].tolist()
    prefix = len(tokens) - SELECTOR_TAIL
    assert listed[-1] < prefix - n_exact, (prefix, listed[-1])
    ref, mats = reference_and_maps(model, maps)
    score = ref.probe_scores(tokens[:-1], SPLIT, SELECTOR_TAIL - 1, n_probe, mats, exact=set(listed))
    ranked = sorted(set(range(1, prefix)) - set(listed), key=lambda r: (-score[r], r))
    chosen = set(ranked[:n_exact])
    st = stats["sel"]
    assert st["applied"] == 1 and st["n_probe_exact"] == n_exact
    assert st["exact_rows"] == sorted({0} | set(listed) | chosen), (st["exact_rows"], sorted(chosen))
    expected = ref.ridgefill_forward(tokens, SPLIT, SELECTOR_TAIL, "ridge", mats, set(listed) | chosen)[-1]
    assert np.abs(arrays["sel"] - expected).max() / np.abs(expected).max() < 2e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_the_attention_selector_keeps_the_rows_the_last_rows_attend_to_most_below_the_split(arch, deep_tiny, tmp_path):
    require_builds("ridgefill")
    n_query, share = 24, 0.1

    def scores(ref, mats, prompt):
        prefix = len(prompt) + 1 - SELECTOR_TAIL
        return ref.attention_scores(prompt, [0], n_query), int(share * prefix + 0.5)  # half up, as the engine

    st = run_selector(arch, deep_tiny, tmp_path, {"attention": [n_query, share, [0]]}, scores)
    assert st["n_attention"] == st["n_exact"] - 1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_question_blind_probe_ranks_by_the_prefixs_last_rows_and_leaves_them_filled(arch, deep_tiny, tmp_path):
    require_builds("ridgefill")
    n_probe, n_exact = 16, 8

    def scores(ref, mats, prompt):
        score = ref.probe_scores(prompt, SPLIT, SELECTOR_TAIL - 1, n_probe, mats, blind=True)
        prefix = len(prompt) + 1 - SELECTOR_TAIL
        score[prefix - n_probe:prefix] = -np.inf  # its own rows are not candidates
        return score, n_exact

    st = run_selector(arch, deep_tiny, tmp_path, {"probe": [n_probe, n_exact], "blind": True}, scores)
    assert st["n_probe_exact"] == n_exact


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_question_blind_attention_selector_reads_the_prefixs_last_rows(arch, deep_tiny, tmp_path):
    require_builds("ridgefill")
    n_query, share = 24, 0.1

    def scores(ref, mats, prompt):
        prefix = len(prompt) + 1 - SELECTOR_TAIL
        return ref.attention_scores(prompt, [0], n_query, end=prefix), int(share * prefix + 0.5)

    run_selector(arch, deep_tiny, tmp_path, {"attention": [n_query, share, [0]], "blind": True}, scores)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_value_and_key_rescales_match_an_independent_numpy_computation(arch, deep_tiny, tmp_path):
    require_builds("ridgefill")
    model, maps = deep_tiny[arch]
    tail, c = 40, 16
    base = {"fill": "ridge", "tail": tail, "chunk": 48, "min_prefix": 0, "exact_rows": []}
    runs = [{"name": "plain", "params": {**base, "rescale": [0, False, False]}},
            {"name": "values", "params": {**base, "rescale": [c, True, False]}},
            {"name": "both", "params": {**base, "rescale": [c, True, True]}}]
    arrays, stats = run_engine(model, maps, runs, session=TIGHT, tmp_path=tmp_path)
    tokens = arrays["tokens"].tolist()
    ref, mats = reference_and_maps(model, maps)
    for name, rescale in (("values", (c, True, False)), ("both", (c, True, True))):
        # the engine prefills all but the last token, so its tail's first rows are the reference's
        expected = ref.ridgefill_forward(tokens, SPLIT, tail, "ridge", mats, rescale=rescale)[-1]
        rel = np.abs(arrays[name] - expected).max() / np.abs(expected).max()
        print(f"{arch} {name}: rel {rel:.2e}")
        assert rel < 2e-5, (name, rel)
    assert np.abs(arrays["values"] - arrays["plain"]).max() > 1e-4 * np.abs(arrays["plain"]).max()


def test_the_rescales_apply_after_the_probe_chose_its_rows(deep_tiny, tmp_path):
    require_builds("ridgefill")
    model, maps = deep_tiny["qwen3"]
    runs = [{"name": "probe", "params": {"fill": "ridge", "tail": 40, "chunk": 48, "min_prefix": 0, "exact_rows": [],
                                         "probe": [16, 8], "rescale": [16, True, True]}}]
    arrays, stats = run_engine(model, maps, runs, session=TIGHT, tmp_path=tmp_path)
    tokens = arrays["tokens"].tolist()
    chosen = set(stats["probe"]["exact_rows"]) - {0}
    assert len(chosen) == 8
    ref, mats = reference_and_maps(model, maps)
    expected = ref.ridgefill_forward(tokens, SPLIT, 40, "ridge", mats, chosen, rescale=(16, True, True))[-1]
    assert np.abs(arrays["probe"] - expected).max() / np.abs(expected).max() < 2e-5


def test_a_probe_that_keeps_every_prefix_row_gives_the_plumb_logits(deep_tiny, tmp_path):
    require_builds("ridgefill")
    model, maps = deep_tiny["qwen3"]
    runs = [{"name": "plumb", "params": {"fill": "plumb", "tail": 40, "min_prefix": 0}},
            {"name": "probe_all", "params": {"fill": "ridge", "probe": [16, 100000]}},
            {"name": "no_probe", "params": {"fill": "ridge", "probe": [0, 0]}}]
    arrays, stats = run_engine(model, maps, runs, session=TIGHT, tmp_path=tmp_path)
    assert stats["probe_all"]["n_filled"] == 0 and stats["no_probe"]["n_probe"] == 0
    assert np.abs(arrays["probe_all"] - arrays["plumb"]).max() <= 1e-5 * np.abs(arrays["plumb"]).max()
    assert np.abs(arrays["no_probe"] - arrays["plumb"]).max() > 1e-4 * np.abs(arrays["plumb"]).max()


@pytest.mark.parametrize("flash_attn", [False, True])
def test_plumb_oracle_and_nothing_filled_reproduce_stock(flash_attn, deep_tiny, tmp_path):
    require_builds("ridgefill")
    model, maps = deep_tiny["qwen3"]
    n_rows = None
    runs = [{"name": "stock", "stock": True},
            {"name": "plumb", "params": {"fill": "plumb", "tail": 40, "min_prefix": 0}},
            {"name": "oracle", "params": {"fill": "oracle"}},
            {"name": "nothing_filled", "params": {"fill": "ridge", "tail": 100000}},
            {"name": "ridge", "params": {"fill": "ridge", "tail": 40}}]
    arrays, stats = run_engine(model, maps, runs, session={"flash_attn": flash_attn}, tmp_path=tmp_path)
    stock = arrays["stock"]
    n_rows = len(arrays["tokens"]) - 1
    for name in ("plumb", "oracle", "nothing_filled"):
        assert stats[name]["applied"] == 1, stats[name]
        assert arrays[name].argmax() == stock.argmax(), name
        assert kl(stock, arrays[name]) < 1e-6, (name, kl(stock, arrays[name]))
    assert stats["nothing_filled"]["n_filled"] == 0 and stats["nothing_filled"]["n_tail"] == n_rows
    assert stats["oracle"]["n_filled"] == stats["ridge"]["n_filled"] > 0
    # the approximate arm is not stock
    assert kl(stock, arrays["ridge"]) > 1e-9


@pytest.mark.parametrize("flash_attn", [False, True])
def test_masks_made_in_the_graphs_give_the_bytes_of_llama_cpps_host_made_masks(flash_attn, deep_tiny, tmp_path):
    """Sweep one's masks and the exact rows' (hidden cells included: the probe's unwritten tail, fill=none)."""
    require_builds("ridgefill")
    model, maps = deep_tiny["qwen3"]
    arms = (("ridge", {}), ("probe", {"probe": [16, 8]}), ("attention", {"attention": [24, 0.1, [0]]}),
            ("none", {"fill": "none", "logits_rows": 4}))
    runs = [{"name": name, "params": {"fill": "ridge", "tail": 40, "chunk": 48, "min_prefix": 0, **extra}}
            for name, extra in arms]
    session = {"flash_attn": flash_attn, "n_ubatch": 16}  # many ubatches, each with its own mask
    device, st = run_engine(model, maps, runs, session=session, tmp_path=tmp_path)
    host, st_host = run_engine(model, maps, runs, session=session, tmp_path=tmp_path,
                               env={"LLAMA_RIDGEFILL_HOST_MASK": "1"})
    for name in ("ridge", "probe", "attention", "none"):
        assert st[name]["applied"] == 1 and st[name]["exact_rows"] == st_host[name]["exact_rows"]
        assert (st[name]["device_mask"], st_host[name]["device_mask"]) == (1, 0), "each path ran"
        assert_same_bytes(device[name], host[name], name)


def test_resident_and_streamed_maps_give_byte_identical_logits(deep_tiny, tmp_path):
    require_builds("ridgefill")
    model, maps = deep_tiny["llama"]
    runs = [{"name": "ridge", "params": {"fill": "ridge", "tail": 40, "chunk": 64}}]
    resident, _ = run_engine(model, maps, runs, tmp_path=tmp_path)
    streamed, _ = run_engine(model, maps, runs, session={"placement": "streamed"}, tmp_path=tmp_path)
    assert_same_bytes(resident["ridge"], streamed["ridge"])


def test_rows_are_counted_and_special_tokens_always_run_exactly(deep_tiny, tmp_path):
    require_builds("ridgefill")
    model, maps = deep_tiny["qwen2"]
    prompt = TEXT[:400] + "<|im_start|>" + TEXT[400:]
    runs = [{"name": "ridge", "params": {"fill": "ridge", "tail": 30, "min_prefix": 0}},
            {"name": "random", "params": {"exact_random": [25, 7]}}]
    arrays, stats = run_engine(model, maps, runs, prompt=prompt, special=True, tmp_path=tmp_path)
    n_rows = len(arrays["tokens"]) - 1
    st = stats["ridge"]
    assert st["n_special"] == 2  # BOS and <|im_start|>
    assert st["n_exact"] == 2 and st["n_tail"] == 29  # the 30th tail row is the stock decode's
    assert st["n_filled"] + st["n_exact"] + st["n_tail"] == st["n_rows"] == n_rows
    assert st["split"] == SPLIT and st["t_total_ms"] > 0
    assert stats["random"]["n_exact"] == 2 + 25 and stats["random"]["n_filled"] == st["n_filled"] - 25


def test_a_prompt_too_short_for_ridgefill_takes_the_stock_path_untouched(deep_tiny, tmp_path):
    require_builds("ridgefill")
    model, maps = deep_tiny["qwen3"]
    runs = [{"name": "stock", "stock": True},
            {"name": "short", "params": {"fill": "ridge", "tail": 40, "min_prefix": 4096}}]
    arrays, stats = run_engine(model, maps, runs, tmp_path=tmp_path)
    assert stats["short"]["applied"] == 0
    assert "min_prefix 4096" in stats["short"]["reason"]
    assert_same_bytes(arrays["short"], arrays["stock"])


def as_architecture(src, dst, arch: str):
    """A copy of a GGUF under another architecture's name (its keys renamed), e.g. a llama model as smollm3, whose
    loader reads the same keys and tensors."""
    from ridgefill_gguf.gguf_io import copy_tensors, writer_like

    w, r = writer_like(src, dst, arch)
    copy_tensors(r, w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_attaching_maps_to_an_architecture_without_the_prefill_is_refused_by_name(tmp_path):
    require_builds("ridgefill")
    arch = "smollm3"  # llama's keys and tensors under a name the engine has no adapter for
    shape = dataclasses.replace(tiny_shape("llama"), n_layer=4)
    llama = write_random_model(tmp_path / "llama.gguf", shape, seed=1)
    src = write_float_file(tmp_path / "m.safetensors", 1, [2, 3], shape.n_embd, dtype="f32")
    llama_maps = convert(src, tmp_path / "llama.maps.gguf", model=llama, outtype="f32").out
    model = as_architecture(llama, tmp_path / "m.gguf", arch)
    maps = as_architecture(llama_maps, tmp_path / "m.maps.gguf", arch)
    code = f"""
from ridgefill_gguf import libs
from ridgefill_gguf.engine import bindings
llama_cpp = libs.use_build("ridgefill")
llm = llama_cpp.Llama(model_path={str(model)!r}, n_ctx=64, verbose=False)
m = bindings.load_maps(llm.model, {str(maps)!r})
try:
    bindings.attach(llm.ctx, m)
    print("ATTACHED")
except bindings.RidgeFillUnavailable as e:
    print("REFUSED", e)
llm.eval(llm.tokenize(b"still serving", add_bos=True))
print("SERVED")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, timeout=300).stdout
    assert f"REFUSED the RidgeFill prefill does not support architecture {arch}" in out, out[-2000:]
    assert "SERVED" in out


def test_the_equivalence_command_takes_maps_and_a_prompts_file_and_exits_zero_when_identical(deep_tiny, tmp_path):
    require_builds()
    model, maps = deep_tiny["qwen2"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(TEXT + "\n---\nA second, short prompt.\n")
    proc = subprocess.run([sys.executable, "-m", "ridgefill_gguf.cli", "equivalence", str(model), "--maps", str(maps),
                           "--prompts", str(prompts), "--n-ctx", "512", "--decode-steps", "2",
                           "--json", str(tmp_path / "eq.json")], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "byte-identical" in proc.stdout
    report = json.loads((tmp_path / "eq.json").read_text())
    assert report["maps"] == str(maps) and len(report["spec"]["prompts"]) == 2


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tail_rows_logits_from_the_prefill_match_numpy_for_every_arm(arch, deep_tiny, tmp_path):
    require_builds("ridgefill")
    model, maps = deep_tiny[arch]
    tail = 40
    base = {"tail": tail, "chunk": 48, "min_prefix": 0}
    runs = [{"name": "stock", "stock": True, "rows": tail}] + [
        {"name": fill, "rows": tail, "params": {**base, "fill": fill}} for fill in ("ridge", "identity", "none",
                                                                                   "oracle", "plumb")]
    arrays, stats = run_engine(model, maps, runs, session=TIGHT, tmp_path=tmp_path)
    tokens = arrays["tokens"].tolist()
    ref, mats = reference_and_maps(model, maps)
    want = {fill: ref.ridgefill_forward(tokens, SPLIT, tail, fill, mats if fill == "ridge" else None)
            for fill in ("ridge", "identity", "none", "oracle")}
    want["plumb"] = ref.forward(tokens)[0][-tail:]
    assert np.abs(arrays["stock"] - want["plumb"]).max() / np.abs(want["plumb"]).max() < 2e-5
    for name, expected in want.items():
        got = arrays[name]
        assert got.shape == expected.shape == (tail, expected.shape[1])
        rel = np.abs(got - expected).max() / np.abs(expected).max()
        print(f"{arch} {name}: rel {rel:.2e} over {tail} rows")
        assert stats[name]["applied"] == 1 and stats[name]["n_tail"] == tail
        assert rel < 2e-5, (name, rel)
    # none differs from the arms that write something
    assert np.abs(arrays["none"] - arrays["identity"]).max() > 1e-3


BUDGET_TEXT = ("The river bends twice before it reaches the old mill by the bridge. " * 5 +
               "The locker code for the blue heron exhibit is 4417, written on card 12. " +
               "The river bends twice before it reaches the old mill by the bridge. " * 4 +
               "Which locker code opens the blue heron exhibit?")


def run_rules_arm(arch, deep_tiny, tmp_path, params: dict, session=TIGHT, prompt=BUDGET_TEXT):
    """One ridge prefill of the prompt with maps that carry a token frequency table; returns (the prefill's tokens,
    pieces, breaks, the frequency table, the prefill's logits, its stats, NumPy reference, maps)."""
    from ridgefill_gguf.select.unigrams import with_token_freq

    model, maps = deep_tiny[arch]
    n_vocab = len(read_gguf(model).get("tokenizer.ggml.tokens"))
    freq = np.random.default_rng(1).integers(1, 40, n_vocab).astype(np.float32)
    freq_maps = with_token_freq(maps, freq, tmp_path / "freq.maps.gguf")
    runs = [{"name": "sel", "params": {"fill": "ridge", "tail": SELECTOR_TAIL, "chunk": 48, "min_prefix": 0,
                                       "exact_rows": [], **params}}]
    spec_session = {**session, "maps": str(freq_maps)}
    arrays, stats = run_engine(model, freq_maps, runs, session=spec_session, tmp_path=tmp_path, prompt=prompt,
                               pieces=True)
    tokens = arrays["tokens"].tolist()
    pieces = [bytes.fromhex(p) for p in stats["_prompt"]["pieces"]]
    ref, mats = reference_and_maps(model, maps)
    return tokens, pieces, stats["_prompt"]["breaks"], freq, arrays["sel"], stats["sel"], ref, mats


def half_up(x: float) -> int:
    return int(x + 0.5)  # std::lround for x >= 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_budgeted_probe_counts_e_from_the_base_rules_keeps_lexical_rows_and_ranks_the_rest_as_numpy(
        arch, deep_tiny, tmp_path):
    require_builds("ridgefill")
    check_budgeted_probe(arch, deep_tiny, tmp_path)


def check_budgeted_probe(arch, deep_tiny, tmp_path, session=TIGHT, tolerance=2e-5, prompt_text=BUDGET_TEXT,
                         whole_numbers=True) -> set[int]:
    """The default selector's E, lexical rows, probe ranking and whole numbers equal the Python rules and NumPy.
    Returns the rows it added to keep numbers whole."""
    from ridgefill_gguf.select import rules

    n_probe, n_query, factor = 16, 24, 1.0
    tokens, pieces, breaks, freq, logits, st, ref, mats = run_rules_arm(
        arch, deep_tiny, tmp_path, {"probe_budget": [n_probe, factor], "attention": [n_query, 0.0, [0]],
                                    "whole_numbers": whole_numbers}, session, prompt_text)
    prompt = tokens[:-1]  # the last token follows through llama_decode
    n, prefix = len(prompt), len(tokens) - SELECTOR_TAIL
    pieces, breaks = pieces[:n], breaks[:n]
    special = {0}
    protected = set(rules.protected_rows(pieces, breaks, prompt, prefix, freq, 0.5)) - special
    digits = set(rules.digit_rows(pieces, breaks, prefix)) - special
    attn = ref.attention_scores(prompt, [0], n_query)
    candidates = sorted(set(range(prefix)) - special, key=lambda r: (-attn[r], r))
    attention = set(candidates[:half_up(0.2 * prefix)])
    e = min(half_up(factor * len(protected | digits | attention)), prefix - len(special))
    lexical = set([r for r in rules.lexical_rows(pieces, breaks, prefix) if r not in special][:e])
    assert lexical and digits, "the prompt should exercise every rule"
    print(f"{arch}: prefix {prefix}, E {e} (protected {len(protected)}, digits {len(digits)}, attention "
          f"{len(attention)}), lexical {len(lexical)}")
    assert (st["n_budget"], st["n_budget_protected"], st["n_budget_digits"], st["n_budget_attention"],
            st["n_lexical"]) == (e, len(protected), len(digits), len(attention), len(lexical))
    score = ref.probe_scores(prompt, SPLIT, SELECTOR_TAIL - 1, n_probe, mats, exact=lexical)
    ranked = sorted(set(range(1, prefix)) - lexical, key=lambda r: (-score[r], r))
    chosen = set(ranked[:e - len(lexical)])
    whole = set(rules.whole_number_rows(digits, special | lexical | chosen)) if whole_numbers else set()
    assert st["exact_rows"] == sorted(special | lexical | chosen | whole) and st["n_probe_exact"] == len(chosen)
    assert st["n_whole_numbers"] == len(whole)
    # the engine says which rows each rule added (API 22): the instruments count a row's reason from it
    assert st["lexical_rows"] == sorted(lexical) and st["whole_numbers_rows"] == sorted(whole)
    expected = ref.ridgefill_forward(tokens, SPLIT, SELECTOR_TAIL, "ridge", mats, lexical | chosen | whole)[-1]
    assert np.abs(logits - expected).max() / np.abs(expected).max() < tolerance
    return whole


NUMBERS_TEXT = ("The river bends twice before it reaches the old mill by the bridge. " * 3 +
                "".join(f"Locker {k} opens with code {c}, stamped {d}. " for k, c, d in
                        [(31, 904417725513, 1887), (57, 662019384455, 1902), (83, 170034982216, 1931)]) +
                "The river bends twice before it reaches the old mill by the bridge. " * 3 +
                "Locker 57 opens with which code?")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_number_the_budgeted_probe_keeps_in_part_runs_exactly_whole(arch, deep_tiny, tmp_path):
    require_builds("ridgefill")
    from ridgefill_gguf.select import rules

    assert not check_budgeted_probe(arch, deep_tiny, tmp_path / "off", prompt_text=NUMBERS_TEXT, whole_numbers=False)
    whole = check_budgeted_probe(arch, deep_tiny, tmp_path / "on", prompt_text=NUMBERS_TEXT)
    assert whole, "the prompt should leave some number exact in part"
    assert rules.whole_number_rows([3, 4, 5, 9, 10, 12], {4, 12}) == [3, 5]  # runs 3-5 and 12 touched, 9-10 not


@pytest.mark.parametrize("share", [0.25, 0.1])
def test_the_protected_selector_keeps_the_rarest_share_of_the_protected_class_tokens(share, deep_tiny, tmp_path):
    require_builds("ridgefill")
    from ridgefill_gguf.select import rules

    tokens, pieces, breaks, freq, logits, st, ref, mats = run_rules_arm("llama", deep_tiny, tmp_path,
                                                                        {"protected": share})
    prompt, prefix = tokens[:-1], len(tokens) - SELECTOR_TAIL
    chosen = set(rules.protected_rows(pieces[:len(prompt)], breaks[:len(prompt)], prompt, prefix, freq, share)) - {0}
    assert chosen and st["exact_rows"] == sorted({0} | chosen) and st["n_protected"] == len(chosen)
    expected = ref.ridgefill_forward(tokens, SPLIT, SELECTOR_TAIL, "ridge", mats, chosen)[-1]
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 2e-5


def test_the_question_blind_budget_reads_its_lexical_window_at_the_prefixs_end(deep_tiny, tmp_path):
    require_builds("ridgefill")
    from ridgefill_gguf.select import rules

    params = {"probe_budget": [16, 1.0], "attention": [24, 0.0, [0]]}
    tokens, pieces, breaks, *_, probe_st, _, _ = run_rules_arm("llama", deep_tiny, tmp_path / "p", params)
    *_, blind_st, _, _ = run_rules_arm("llama", deep_tiny, tmp_path / "b", {**params, "blind": True})
    prefix = len(tokens) - SELECTOR_TAIL
    # the question sits in the tail: seen through the prompt's end, hidden from a window that ends with the prefix
    blind_lexical = [r for r in rules.lexical_rows(pieces[:prefix], breaks[:prefix], prefix) if r != 0]
    assert probe_st["n_lexical"] > 0 and blind_st["n_lexical"] == min(len(blind_lexical), blind_st["n_budget"])
    assert blind_st["n_lexical"] < probe_st["n_lexical"]


def test_the_random_control_keeps_as_many_random_rows_as_the_budget_counts(deep_tiny, tmp_path):
    require_builds("ridgefill")
    params = {"attention": [24, 0.0, [0]]}
    *_, probe_st, _, _ = run_rules_arm("llama", deep_tiny, tmp_path / "p", {**params, "probe_budget": [16, 1.0]})
    tokens, *_, logits, st, ref, mats = run_rules_arm("llama", deep_tiny, tmp_path / "r",
                                                      {**params, "random_budget": [1.0, 7]})
    assert st["n_budget"] == probe_st["n_budget"] > 0 and st["n_random"] == st["n_budget"]
    assert st["n_probe"] == 0 and st["n_lexical"] == 0 and len(st["exact_rows"]) == 1 + st["n_budget"]
    assert st["exact_rows"] != probe_st["exact_rows"]
    expected = ref.ridgefill_forward(tokens, SPLIT, SELECTOR_TAIL, "ridge", mats, set(st["exact_rows"]) - {0})[-1]
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 2e-5


def test_the_protected_selector_is_refused_by_name_when_the_maps_have_no_frequency_table(deep_tiny, tmp_path):
    require_builds("ridgefill")
    model, maps = deep_tiny["llama"]
    runs = [{"name": "sel", "params": {"fill": "ridge", "tail": SELECTOR_TAIL, "min_prefix": 0, "protected": 0.25}}]
    with pytest.raises(AssertionError, match=r"no token frequency table \(rf_token_freq\).*ridgefill-gguf unigrams"):
        run_engine(model, maps, runs, tmp_path=tmp_path)


LARGER_BUDGET_SCRIPT = r'''
import json, sys
import numpy as np
from ridgefill_gguf.engine.session import Session

cfg = json.loads(sys.argv[1])
S = Session(cfg["model"], n_ctx=1024, n_batch=64, n_ubatch=32, n_threads=2, maps=cfg["maps"])
rng = np.random.default_rng(3)
prompt = [int(t) for t in rng.integers(1000, 5000, 400)]
rows = {}
for factor in (1.0, 1.5, 2.0):
    st = S.ridgefill(prompt, tail=40, fill="ridge", chunk=48, min_prefix=0, probe_budget=[16, factor])[2]
    rows[str(factor)] = st["exact_rows"]
print("RESULT " + json.dumps(rows))
'''


def test_a_larger_budget_keeps_every_row_the_default_budget_kept_and_more(tmp_path):
    require_builds("ridgefill")
    from ridgefill_gguf.maps.synthetic import tiny_model_with_maps
    from test_engine_steps import run_script

    model, maps = tiny_model_with_maps(tmp_path, "llama", n_layer=4, split=1)
    rows = run_script(LARGER_BUDGET_SCRIPT, {"model": str(model), "maps": str(maps)})
    one, one_half, two = (set(rows[k]) for k in ("1.0", "1.5", "2.0"))
    assert one < one_half < two  # the probe ranks the same scores and takes more of them
