"""The maps loader against hostile files: 10,000 mutated copies of two good maps files (a dense model's and a
hybrid's with terminal-state offsets) - truncations, bit flips, random bytes, NaN and Inf written over values,
wrong types, shapes, counts and names - are each loaded by the engine in one process. None may crash it; each is
refused with a message that names a problem, or loads with finite values only; the model serves stock afterwards."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import require_builds, run_py
from ridgefill_gguf.gguf_io import read_gguf
from ridgefill_gguf.maps.convert import convert
from ridgefill_gguf.maps.state_delta import write_state_deltas
from ridgefill_gguf.maps.synthetic import write_float_file
from ridgefill_gguf.random_gguf import tiny_shape, write_random_model

N_FILES = 10_000


def mutations(data: bytes, header_end: int, rng: np.random.Generator, n: int):
    """n mutated copies: (kind, bytes). Header mutations hit the key/value and tensor-info region, where the
    types, shapes, counts and names are; value mutations hit the data."""
    size = len(data)
    for i in range(n):
        b = bytearray(data)
        kind = ("truncate", "flip-header", "flip-data", "bytes-header", "bytes-data", "nan", "inf")[i % 7]
        if kind == "truncate":
            b = b[: int(rng.integers(0, size))]
        elif kind.startswith("flip"):
            lo, hi = (0, header_end) if kind == "flip-header" else (header_end, size)
            for _ in range(int(rng.integers(1, 9))):
                p = int(rng.integers(lo, hi))
                b[p] ^= 1 << int(rng.integers(0, 8))
        elif kind.startswith("bytes"):
            lo, hi = (0, header_end) if kind == "bytes-header" else (header_end, size)
            p = int(rng.integers(lo, hi - 8))
            b[p: p + 8] = rng.integers(0, 256, 8, dtype=np.uint8).tobytes()
        else:  # a non-finite float32 or float16 at an aligned place in the data
            value = np.float32(np.nan if kind == "nan" else np.inf)
            p = header_end + 2 * int(rng.integers(0, (size - header_end) // 2 - 2))
            b[p: p + 4] = value.tobytes() if p % 4 == 0 else np.float16(value).tobytes() + b[p + 2: p + 4]
        yield kind, bytes(b)


@pytest.fixture(scope="module")
def good_maps(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    out = {}
    shape = dataclasses.replace(tiny_shape("qwen3"), n_layer=4)
    model = write_random_model(d / "qwen3.gguf", shape, seed=1)
    src = write_float_file(d / "q.safetensors", 1, [2, 3], shape.n_embd, dtype="f32", seed=2)
    out["dense"] = (model, convert(src, d / "q.maps.gguf", model=model).out)  # Q8_0 maps
    shape = dataclasses.replace(tiny_shape("qwen35"), n_layer=8)
    model = write_random_model(d / "qwen35.gguf", shape, seed=3)
    src = write_float_file(d / "h.safetensors", 2, list(range(3, 8)), shape.n_embd, dtype="f32", seed=4)
    maps = convert(src, d / "h.plain.gguf", model=model, outtype="f32").out
    state = shape.recurrent_state_shape
    deltas = {il: np.random.default_rng(il).normal(0, 0.1, state).astype(np.float32) for il in (4, 5, 6)}
    out["hybrid"] = (model, write_state_deltas(maps, deltas, d / "h.maps.gguf"))
    return out, d


def test_ten_thousand_mutated_maps_files_are_refused_by_name_or_load_finite_and_nothing_crashes(good_maps):
    require_builds("ridgefill")
    cases, d = good_maps
    rng = np.random.default_rng(0)
    for name, (model, maps) in cases.items():
        data = Path(maps).read_bytes()
        g = read_gguf(maps)
        header_end = min(t.offset for t in g.tensors.values())
        folder = d / name
        folder.mkdir(exist_ok=True)
        kinds = {}
        for i, (kind, blob) in enumerate(mutations(data, header_end, rng, N_FILES // len(cases))):
            (folder / f"{i:05d}.gguf").write_bytes(blob)
            kinds[i] = kind
        (folder / "kinds.json").write_text(json.dumps(kinds))
    code = f"""
import json, math, sys
from pathlib import Path
from ridgefill_gguf import libs
from ridgefill_gguf.engine import bindings
llama_cpp = libs.use_build("ridgefill")
result = {{}}
for name, model in {json.dumps({k: str(v[0]) for k, v in cases.items()})}.items():
    llm = llama_cpp.Llama(model_path=model, n_ctx=128, verbose=False)
    folder = Path({str(d)!r}) / name
    refused, loaded, silent, loaded_files = 0, 0, [], []
    for path in sorted(folder.glob("*.gguf")):
        print(path, file=sys.stderr, flush=True)  # the last one named is the one that crashed, if any
        try:
            m = bindings.load_maps(llm.model, path)
        except bindings.MapsRefused as e:
            refused += 1
            if not str(e).split(": ", 1)[-1].strip():
                silent.append(path.name)
            continue
        loaded += 1
        loaded_files.append(path.name)
        m.free()
    llm.reset()
    llm.eval(llm.tokenize(b"still serving the stock way", add_bos=True))
    result[name] = {{"refused": refused, "loaded": loaded, "silent": silent, "loaded_files": loaded_files,
                     "finite": all(math.isfinite(x) for x in llm.scores[llm.n_tokens - 1][:16])}}
print(json.dumps(result))
"""
    proc = run_py(code, "ridgefill", check=False)
    assert proc.returncode == 0, f"the engine crashed ({proc.returncode}) on: {proc.stdout.strip().splitlines()[-1:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print({name: {k: v for k, v in r.items() if k != "loaded_files"} for name, r in result.items()})
    for name, r in result.items():
        assert r["refused"] + r["loaded"] == N_FILES // len(cases)
        assert not r["silent"] and r["finite"]
        kinds = json.loads((d / name / "kinds.json").read_text())
        loaded = {int(f.split(".")[0]) for f in r["loaded_files"]}
        per_kind = {k: [sum(1 for i, x in kinds.items() if x == k and int(i) in loaded),
                        sum(1 for x in kinds.values() if x == k)] for k in sorted(set(kinds.values()))}
        print(f"{name}: loaded / made per mutation: {per_kind}")
        assert per_kind["truncate"][0] == 0  # a cut file never loads
        # a changed value that stays finite cannot be told from a fitted one (the checksum's job, not done yet)
    # what the engine loaded holds finite values only: the loader's Python twin agrees
    from ridgefill_gguf.maps.format import check_values

    from ridgefill_gguf.gguf_io import GGUFFormatError

    for name, r in result.items():
        stricter = 0  # gguf_io refuses strings that are not UTF-8, which the engine's reader passes through
        for file in r["loaded_files"][:400]:
            try:
                g = read_gguf(d / name / file)
            except GGUFFormatError:
                stricter += 1
                continue
            assert not check_values(g), f"{name}/{file} loaded with a non-finite value"
        assert stricter < 40, stricter


def test_a_change_that_keeps_every_value_finite_is_found_by_the_tensor_data_checksum(good_maps, tmp_path):
    from ridgefill_gguf.maps.format import DATA_SHA256, check_checksum

    cases, _ = good_maps
    model, maps = cases["dense"]
    g = read_gguf(maps)
    assert len(g.get(DATA_SHA256)) == 64 and not check_checksum(g)  # every writer seals what it writes
    bad = tmp_path / "one-byte.gguf"
    blob = bytearray(Path(maps).read_bytes())
    w = g.tensors["blk.2.rf_map.weight"]
    blob[w.offset + 40] ^= 0x01  # an int8 quant: still finite
    bad.write_bytes(bytes(blob))
    problems = check_checksum(read_gguf(bad))
    assert problems and "do not match ridgefill.tensor_data_sha256" in problems[0]
    require_builds("ridgefill")
    code = f"""
import os
from ridgefill_gguf import libs
from ridgefill_gguf.engine import bindings
llama_cpp = libs.use_build("ridgefill")
llm = llama_cpp.Llama(model_path={str(model)!r}, n_ctx=64, verbose=False)
bindings.load_maps(llm.model, {str(bad)!r}).free()
print("LOADED without the check")
"""
    assert "LOADED without the check" in run_py(code, "ridgefill").stdout
    env_code = "import os; os.environ['LLAMA_RIDGEFILL_VERIFY_DATA'] = '1'\n" + code.replace(
        'print("LOADED without the check")', "")
    env_code = env_code.replace("bindings.load_maps(llm.model, " + repr(str(bad)) + ").free()", f"""
try:
    bindings.load_maps(llm.model, {str(bad)!r})
except bindings.MapsRefused as e:
    print("REFUSED", e)
bindings.load_maps(llm.model, {str(maps)!r}).free()
print("GOOD LOADED")""")
    out = run_py(env_code, "ridgefill").stdout
    assert "REFUSED" in out and "the tensor data do not match ridgefill.tensor_data_sha256" in out and "GOOD LOADED" in out


def test_adding_a_frequency_table_keeps_a_hybrids_state_offsets_and_seals_the_new_file(good_maps, tmp_path):
    from ridgefill_gguf.maps.format import check_checksum
    from ridgefill_gguf.select.unigrams import with_token_freq

    cases, _ = good_maps
    model, maps = cases["hybrid"]
    before = read_gguf(maps)
    n_vocab = len(read_gguf(model).fields["tokenizer.ggml.tokens"][1])
    out = with_token_freq(maps, np.ones(n_vocab, np.float32), tmp_path / "with-table.gguf")
    after = read_gguf(out)
    for il in (4, 5, 6):
        name = f"blk.{il}.rf_state_delta"
        assert np.array_equal(np.asarray(after.raw(name)), np.asarray(before.raw(name)))
    assert "rf_token_freq" in after.tensors and not check_checksum(after)
