"""The engine loads maps files with the same checks and words as `ridgefill-gguf verify`."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import require_builds, run_py
from ridgefill_gguf.gguf_io import read_gguf
from ridgefill_gguf.maps import format as fmt
from ridgefill_gguf.maps.convert import convert
from ridgefill_gguf.maps.synthetic import write_float_file

LOAD = r"""
import json, sys
from ridgefill_gguf import libs
from ridgefill_gguf.engine import bindings
llama_cpp = libs.use_build("ridgefill")
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, verbose=False)
out = {}
for path in sys.argv[2:]:
    for placement in ("resident", "streamed"):
        try:
            m = bindings.load_maps(llm.model, path, placement)
            out[f"{path}|{placement}"] = {"split": m.split, "layers": m.layers, "tail": m.tail_default,
                                          "lam": m.lam, "bytes": m.bytes, "warnings": m.warnings}
            m.free()
        except bindings.MapsRefused as e:
            out[f"{path}|{placement}"] = {"refused": str(e)}
# the model still serves after refusals
llm.eval(llm.tokenize(b"still serving", add_bos=True))
out["served"] = True
print(json.dumps(out))
"""


def engine_load(model, paths) -> dict:
    code = "import sys; sys.argv = ['x', " + ", ".join(repr(str(p)) for p in [model, *paths]) + "]\n" + LOAD
    return json.loads(run_py(code, "ridgefill").stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def maps_files(tmp_path_factory, tiny_models):
    """A good maps file for the tiny qwen3 (64 wide, 2 layers) and bad ones of several kinds."""
    d = tmp_path_factory.mktemp("engine-maps")
    model = tiny_models["qwen3"]
    files = {}
    src = write_float_file(d / "f.safetensors", 1, [1], 64, dtype="f32")
    files["good"] = convert(src, d / "good.gguf", model=model).out
    files["good_f32"] = convert(src, d / "good32.gguf", model=model, outtype="f32").out
    wide = write_float_file(d / "wide.safetensors", 1, [1], 128, dtype="f32")
    files["too_wide"] = convert(wide, d / "wide.gguf", arch="qwen3").out
    deep = write_float_file(d / "deep.safetensors", 3, [3, 5], 64, dtype="f32")
    files["beyond"] = convert(deep, d / "deep.gguf", arch="qwen3").out
    other = write_float_file(d / "other.safetensors", 1, [1], 64, dtype="f32")
    files["other_arch"] = convert(other, d / "other.gguf", arch="llama").out
    (d / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    files["junk"] = d / "junk.gguf"
    return model, {k: str(v) for k, v in files.items()}


def test_the_engine_loads_maps_resident_and_streamed(maps_files):
    require_builds("ridgefill")
    model, files = maps_files
    out = engine_load(model, [files["good"], files["good_f32"]])
    for key in ("good", "good_f32"):
        for placement in ("resident", "streamed"):
            got = out[f"{files[key]}|{placement}"]
            assert got.get("split") == 1 and got["layers"] == [1] and got["bytes"] > 0, got
            assert got["tail"] == 1024 and abs(got["lam"] - 0.01) < 1e-6
            assert got["warnings"] == ""  # the engine's vocabulary hash equals the one convert wrote


def test_a_vocabulary_mismatch_is_a_warning_with_verify_s_words_not_a_refusal(maps_files, tmp_path):
    require_builds("ridgefill")
    from ridgefill_gguf.paths import vendor_dir
    from ridgefill_gguf.random_gguf import tiny_shape, write_random_model

    model, files = maps_files
    other = write_random_model(tmp_path / "qwen3-llama-vocab.gguf", tiny_shape("qwen3"),
                               vocab=vendor_dir() / "models" / "ggml-vocab-llama-bpe.gguf", seed=2)
    got = engine_load(other, [files["good"]])[f"{files['good']}|resident"]
    expected = fmt.check_maps(read_gguf(files["good"]), fmt.model_fingerprint(other))
    assert expected.ok and expected.warnings and got.get("layers") == [1]
    assert got["warnings"] == "; ".join(expected.warnings)


@pytest.mark.parametrize("kind", ["too_wide", "beyond", "other_arch"])
def test_the_engine_refuses_what_verify_refuses_with_the_same_words_and_keeps_serving(maps_files, kind):
    require_builds("ridgefill")
    model, files = maps_files
    out = engine_load(model, [files[kind]])
    refused = out[f"{files[kind]}|resident"]["refused"]
    expected = fmt.check_maps(read_gguf(files[kind]), fmt.model_fingerprint(model)).errors
    assert expected and refused == f"{files[kind]}: " + "; ".join(expected)
    assert out["served"] is True


def test_the_engine_refuses_a_file_that_is_not_gguf_by_name(maps_files):
    require_builds("ridgefill")
    model, files = maps_files
    out = engine_load(model, [files["junk"]])
    assert out[f"{files['junk']}|resident"]["refused"] == f"{files['junk']}: not a readable GGUF file"
    assert out["served"] is True


def with_value(src: str, dst, tensor: str, byte_offset: int, raw: bytes):
    """A copy of a maps file with `raw` written at `byte_offset` into one tensor's data."""
    data = bytearray(open(src, "rb").read())
    start = read_gguf(src).tensors[tensor].offset + byte_offset
    data[start:start + len(raw)] = raw
    dst.write_bytes(bytes(data))
    return str(dst)


@pytest.mark.parametrize("tensor, offset, raw, words", [
    # the f16 scale of a Q8_0 weight's third block (block 2 covers elements 64..95): NaN
    ("blk.1.rf_map.weight", 2 * 34, bytes.fromhex("007e"), "(NaN) at element 64"),
    ("blk.1.rf_map.bias", 4 * 5, np.float32(np.inf).tobytes(), "(Inf) at element 5"),
    ("rf_token_freq", 0, np.float32(np.nan).tobytes(), "(NaN) at element 0"),
])
def test_a_non_finite_value_in_a_map_a_bias_or_the_frequency_table_is_refused_by_name(
        maps_files, tmp_path, tensor, offset, raw, words):
    require_builds("ridgefill")
    model, files = maps_files
    good = files["good"]
    if tensor == fmt.TOKEN_FREQ:
        from ridgefill_gguf.maps.merge import merge

        n_vocab = fmt.model_fingerprint(model).n_vocab
        good = str(merge([good], tmp_path / "with-table.gguf", token_freq=np.ones(n_vocab, np.float32)))
    bad = with_value(good, tmp_path / "bad.gguf", tensor, offset, raw)
    expected = fmt.check_values(read_gguf(bad))
    assert expected == [f"tensor {tensor} holds a non-finite value {words}"]
    out = engine_load(model, [bad])
    for placement in ("resident", "streamed"):
        assert out[f"{bad}|{placement}"]["refused"] == f"{bad}: {expected[0]}"
    assert out["served"] is True


def test_a_maps_file_that_leaves_out_a_late_layer_is_refused_not_filled_with_the_identity(tmp_path):
    require_builds("ridgefill")
    import dataclasses

    from ridgefill_gguf.random_gguf import tiny_shape, write_random_model

    shape = dataclasses.replace(tiny_shape("qwen3"), n_layer=5)
    model = write_random_model(tmp_path / "qwen3-5.gguf", shape, seed=3)
    src = write_float_file(tmp_path / "gap.safetensors", 1, [2, 4], shape.n_embd, dtype="f32")
    gap = str(convert(src, tmp_path / "gap.gguf", arch="qwen3").out)
    expected = fmt.check_maps(read_gguf(gap), fmt.model_fingerprint(model)).errors
    assert expected == ["ridgefill.layers leaves out late layers [3]: every layer after the split 1 needs a map"]
    out = engine_load(model, [gap])
    assert out[f"{gap}|resident"]["refused"] == f"{gap}: {expected[0]}"
    assert out["served"] is True
