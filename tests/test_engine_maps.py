"""The engine loads maps files with the same checks and words as `ridgefill-gguf verify`."""
from __future__ import annotations

import json

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
