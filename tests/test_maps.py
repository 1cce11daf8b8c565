"""Maps GGUF (docs/maps-format.md): conversion round trips, the file contract, refused inputs, inspect, verify.

References used here are independent of the code under test: gguf-py (reader and reference quantizer) and
ggml's own C quantizer from the upstream build (`ggml_quantize_chunk`).
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from conftest import assert_same_bytes
from ridgefill_gguf.cli import main
from ridgefill_gguf.gguf_io import GGUFFormatError, read_gguf
from ridgefill_gguf.maps import format as fmt
from ridgefill_gguf.maps.convert import ConvertError, convert
from ridgefill_gguf.maps.inspect import inspect_maps, summary_text
from ridgefill_gguf.maps.quant import f32_to_bf16, int8_groups_to_q8_0, quantize_q8_0
from ridgefill_gguf.maps.safetensors_io import SafetensorsFile, save
from ridgefill_gguf.maps.synthetic import write_float_file, write_int8_folder
from ridgefill_gguf.paths import project_root
from ridgefill_gguf.random_gguf import tiny_shape, write_random_model

ROOT = project_root()
VOCABS = ROOT / "vendor" / "llama.cpp" / "models"
GGML_BASE = ROOT / "build" / "upstream" / "bin" / "libggml-base.so"
GGML_H = ROOT / "vendor" / "llama.cpp" / "ggml" / "include" / "ggml.h"

D = 256            # maps width for the int8 path (a multiple of 128) and the main test model's n_embd
SPLIT, LAYERS = 2, [2, 3]


# ---------------------------------------------------------------------------------------------
# independent helpers (not the code under test)


def bf16_bits_to_f32(u16: np.ndarray) -> np.ndarray:
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_reference(x: np.ndarray) -> np.ndarray:
    """Round to nearest, ties to even, by comparing the two neighbouring bf16 values in float64."""
    x = np.ascontiguousarray(x, dtype=np.float32).ravel()
    u = x.view(np.uint32)
    lo = (u & np.uint32(0xFFFF0000)).astype(np.uint64)
    hi = lo + 0x10000
    v = x.astype(np.float64)
    vlo = (lo.astype(np.uint32)).view(np.float32).astype(np.float64)
    hi_is_inf = (hi & 0x7FFFFFFF) == 0x7F800000  # the step past the largest finite bf16: weigh it as 2**128
    with np.errstate(over="ignore", invalid="ignore"):
        vhi = np.where(hi_is_inf, np.sign(v) * 2.0 ** 128, (hi.astype(np.uint32)).view(np.float32).astype(np.float64))
    with np.errstate(invalid="ignore"):  # inf and NaN inputs: the lower neighbour is the input itself
        dlo, dhi = np.abs(v - vlo), np.abs(vhi - v)
    pick_hi = (dhi < dlo) | ((dhi == dlo) & ((lo >> 16) & 1 == 1))
    return np.where(pick_hi, hi >> 16, lo >> 16).astype(np.uint16)


def gguf_py_q8_0(x: np.ndarray) -> np.ndarray:
    return gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), QT.Q8_0)


def split_q8_0(raw: np.ndarray, d_out: int, d_in: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 bytes -> (f16 scales as float32 [d_out, nb], int8 codes [d_out, nb, 32]), parsed by hand."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(d_out, d_in // 32, 34)
    d = np.ascontiguousarray(blocks[..., :2]).view("<f2")[..., 0].astype(np.float32)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return d, q


def q8_0_error_bound(x: np.ndarray, d16: np.ndarray) -> np.ndarray:
    """Per value: |x - deq| may reach d/2 plus what rounding d to f16 costs on a code of at most 127,
    plus float32 rounding of the product. x [n, k] float32, d16 [n, k/32] (the stored scales)."""
    n, k = x.shape
    blocks = x.reshape(n, k // 32, 32).astype(np.float64)
    d32 = (np.abs(blocks).max(axis=-1) / 127)
    bound = d32 / 2 + 127 * np.abs(d32 - d16.astype(np.float64)) + d32 * 1e-5
    return (bound[..., None] + np.abs(blocks) * 2.0 ** -22 + 1e-45).reshape(n, k)


@pytest.fixture(scope="module")
def ggml_q8_0():
    """ggml's C quantizer (ggml_quantize_chunk) from the upstream build, as a function of float32 rows."""
    if not GGML_BASE.exists():
        pytest.skip(f"{GGML_BASE} is not built (make build): no C reference quantizer")
    m = re.search(r"GGML_TYPE_Q8_0\s*=\s*(\d+)", GGML_H.read_text())
    assert m, "GGML_TYPE_Q8_0 not found in ggml.h"
    q8_0 = int(m.group(1))
    lib = ctypes.CDLL(str(GGML_BASE))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_quantize_init(q8_0)

    def quantize(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        n, k = x.shape
        out = np.zeros((n, k // 32 * 34), dtype=np.uint8)
        size = lib.ggml_quantize_chunk(q8_0, x.ctypes.data, out.ctypes.data, 0, n, k, None)
        assert size == out.nbytes
        return out

    return quantize


def cli(*args) -> "click.testing.Result":  # noqa: F821
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_clean_failure(result, *needles: str) -> None:
    """Non-zero exit, the message on screen, and no traceback (a ClickException or sys.exit, not a crash)."""
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        f"crashed with {type(result.exception).__name__}: {result.exception}"
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, f"{needle!r} not in:\n{result.output}"


def int8_source(folder: Path, d_out: int = D, d_in: int | None = None, layers=LAYERS, split=SPLIT,
                arch: str | None = "qwen3", **kw) -> Path:
    config = {"architecture": arch} if arch else {}
    return write_int8_folder(folder, split, list(layers), d_out, d_in, config=config, **kw)


def float_source(path: Path, d_out: int = 64, d_in: int | None = None, layers=LAYERS, split=SPLIT,
                 dtype: str = "f32", arch: str = "llama", **kw) -> Path:
    return write_float_file(path, split, list(layers), d_out, d_in, dtype=dtype, metadata={"architecture": arch}, **kw)


def edit_safetensors(path: Path, edit) -> None:
    """Rewrite a safetensors file after edit(tensors, bf16_names) changes the tensors dict in place."""
    st = SafetensorsFile(path)
    tensors = {name: np.array(st.get(name)) for name in st.entries}
    bf16 = [name for name, e in st.entries.items() if e.dtype == "BF16"]
    metadata = dict(st.metadata)
    del st
    edit(tensors, bf16)
    save(path, tensors, metadata, bf16=tuple(bf16))


def weight_raw(g, layer: int) -> np.ndarray:
    return np.array(g.raw(fmt.weight_name(layer)))


def bias_values(g, layer: int) -> np.ndarray:
    info = g.tensors[fmt.bias_name(layer)]
    assert info.type == QT.F32
    return np.array(g.raw(info.name)).view(np.float32)


def source_int8(folder: Path, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    st = SafetensorsFile(folder / f"proj8.L{layer}.safetensors")
    return tuple(np.array(st.get(f"proj.{layer}.{k}")) for k in ("codes", "scale", "bias"))


def source_float(path: Path, layer: int) -> tuple[np.ndarray, np.ndarray]:
    st = SafetensorsFile(path)
    out = []
    for k in ("weight", "bias"):
        name = f"proj.{layer}.{k}"
        raw = np.array(st.get(name))
        out.append(bf16_bits_to_f32(raw) if st.entries[name].dtype == "BF16" else raw.astype(np.float32))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# random-weight models for --model and verify: small vocabularies, tied embeddings, f16 (a few MB each)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("maps-models")
    qwen3 = dataclasses.replace(tiny_shape("qwen3"), n_embd=D, n_layer=4, tie_embeddings=True)
    llama = dataclasses.replace(tiny_shape("llama"), n_embd=128, n_layer=2, tie_embeddings=True)
    for s in (qwen3, llama):
        s.validate()
    spm, phi3 = VOCABS / "ggml-vocab-llama-spm.gguf", VOCABS / "ggml-vocab-phi-3.gguf"
    return {
        "qwen3": write_random_model(folder / "qwen3-256.gguf", qwen3, vocab=spm, dtype="f16", seed=1),
        # the same architecture and shape, another tokenizer: only the vocabulary fingerprint differs
        "qwen3-other-vocab": write_random_model(folder / "qwen3-256-phi3.gguf", qwen3, vocab=phi3, dtype="f16", seed=1),
        "llama": write_random_model(folder / "llama-128.gguf", llama, vocab=spm, dtype="f16", seed=2),
    }


@pytest.fixture(scope="module")
def qwen3_maps(tmp_path_factory, models) -> tuple[Path, Path]:
    """(int8 source folder, maps GGUF converted from it with --model qwen3)."""
    folder = tmp_path_factory.mktemp("qwen3-maps")
    src = int8_source(folder / "src", arch=None)
    out = folder / "maps.gguf"
    result = cli("convert", src, "-o", out, "--model", models["qwen3"])
    assert result.exit_code == 0, result.output
    return src, out


# ---------------------------------------------------------------------------------------------
# 1. round trips


def test_int8_maps_repack_into_q8_0_without_changing_a_code(tmp_path):
    src = int8_source(tmp_path / "src", d_out=128, d_in=512)
    out = tmp_path / "maps.gguf"
    report = convert(src, out)
    assert report.requantized_blocks == 0 and report.blocks == len(LAYERS) * 128 * 512 // 32
    g = read_gguf(out)
    for layer in LAYERS:
        codes, scale, bias = source_int8(src, layer)
        info = g.tensors[fmt.weight_name(layer)]
        assert info.type == QT.Q8_0 and info.ne == (512, 128)
        d, q = split_q8_0(weight_raw(g, layer), 128, 512)
        assert np.array_equal(q.reshape(128, 512), codes)
        scale32 = bf16_bits_to_f32(scale)
        assert np.array_equal(d, np.repeat(scale32, 4, axis=1))  # bit-exact: each block takes its group's scale
        expected = (codes.reshape(128, 4, 128).astype(np.float32) * scale32[..., None]).reshape(128, 512)
        deq = gguf.quants.dequantize(weight_raw(g, layer), QT.Q8_0).reshape(128, 512)
        assert np.array_equal(deq, expected)
        assert np.array_equal(bias_values(g, layer), bf16_bits_to_f32(bias))


def _special_scale_folder(folder: Path, *, big_codes: int = 60) -> tuple[Path, dict]:
    """One layer of 64 x 512 int8 (4 scale groups a row) with chosen scales in a few groups."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(7)
    d_out, d_in = 64, 512
    codes = rng.integers(-127, 128, size=(d_out, d_in), dtype=np.int8)
    scale = (rng.uniform(1, 2, size=(d_out, 4)) * 2.0 ** -6).astype(np.float32)
    special = {
        (0, 1): 2.0 ** -20 * (1 + 2 ** -7),  # f16 subnormal range, more mantissa than f16 has there: inexact
        (5, 3): 2.0 ** 17,                   # above 65504: no f16 at all
        (9, 0): 98304.0,                     # above 65504
        (3, 2): 2.0 ** -20,                  # f16 subnormal but exact: repacked as is
        (7, 1): 65280.0,                     # the largest bf16 below 65504: exact in f16
    }
    inexact = [(0, 1), (5, 3), (9, 0)]
    for (r, grp), s in special.items():
        scale[r, grp] = s
    for r, grp in [(5, 3), (9, 0)]:  # keep codes*scale within Q8_0's reach (d = amax/127 <= 65504)
        codes[r, grp * 128:(grp + 1) * 128] = np.clip(codes[r, grp * 128:(grp + 1) * 128], -big_codes, big_codes)
    scale_bits = f32_to_bf16_reference(scale).reshape(d_out, 4)
    assert np.array_equal(bf16_bits_to_f32(scale_bits)[tuple(np.array(list(special)).T)], list(special.values()))
    bias = f32_to_bf16_reference(rng.standard_normal(d_out).astype(np.float32))
    save(folder / "proj8.L2.safetensors", {"proj.2.codes": codes, "proj.2.scale": scale_bits, "proj.2.bias": bias},
         bf16=("proj.2.scale", "proj.2.bias"))
    (folder / "ridgefill.json").write_text(json.dumps({"split": 2, "layers": [2], "architecture": "llama"}))
    return folder, {"codes": codes, "scale": scale_bits, "inexact": inexact}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # scales > 65504
def test_int8_scales_without_an_exact_f16_are_requantized_counted_and_stay_within_the_q8_0_bound(tmp_path):
    src, info = _special_scale_folder(tmp_path / "src")
    codes, scale_bits = info["codes"], info["scale"]
    d_out, d_in = codes.shape
    requantized = {(r, grp * 4 + j) for r, grp in info["inexact"] for j in range(4)}
    assert len(requantized) == 12

    q8, n = int8_groups_to_q8_0(codes, scale_bits)
    assert n == 12

    out = tmp_path / "out" / "maps.gguf"
    result = cli("convert", src, "-o", out)
    assert result.exit_code == 0, result.output
    assert f"{1024 - 12} of 1024 blocks repacked exactly, 12 requantized" in result.output
    raw = weight_raw(read_gguf(out), 2)
    assert np.array_equal(raw, q8.ravel())

    d, q = split_q8_0(raw, d_out, d_in)
    scale32 = np.repeat(bf16_bits_to_f32(scale_bits), 4, axis=1)
    codes_b = codes.reshape(d_out, d_in // 32, 32)
    exact = (codes_b.astype(np.float32) * scale32[..., None]).reshape(d_out, d_in)
    deq = gguf.quants.dequantize(raw, QT.Q8_0).reshape(d_out, d_in)
    bound = q8_0_error_bound(exact, d)
    for r in range(d_out):
        for b in range(d_in // 32):
            cols = slice(b * 32, b * 32 + 32)
            if (r, b) in requantized:
                assert np.isfinite(d[r, b])
                assert np.all(np.abs(deq[r, cols] - exact[r, cols]) <= bound[r, cols]), (r, b)
            else:  # untouched: same codes, same scale
                assert np.array_equal(q[r, b], codes_b[r, b]) and d[r, b] == scale32[r, b], (r, b)
    report = convert(src, tmp_path / "again.gguf")
    assert (report.blocks, report.requantized_blocks) == (1024, 12)


def test_float_maps_quantize_to_q8_0_exactly_as_gguf_py_and_ggml_do(tmp_path, ggml_q8_0):
    src = float_source(tmp_path / "maps.safetensors", d_out=96, d_in=256, dtype="bf16")
    out = tmp_path / "maps.gguf"
    convert(src, out)
    g = read_gguf(out)
    for layer in LAYERS:
        w, b = source_float(src, layer)
        raw = weight_raw(g, layer).reshape(96, -1)
        assert g.tensors[fmt.weight_name(layer)].ne == (256, 96)
        assert np.array_equal(raw, gguf_py_q8_0(w))
        assert np.array_equal(raw, ggml_q8_0(w))
        d, _ = split_q8_0(raw, 96, 256)
        deq = gguf.quants.dequantize(raw, QT.Q8_0).reshape(96, 256)
        assert np.all(np.abs(w - deq) <= q8_0_error_bound(w, d))
        assert np.array_equal(bias_values(g, layer), b)


def _edge_rows(rng: np.random.Generator) -> np.ndarray:
    """Rows of 256 (8 blocks) with the cases that trip quantizers, plus random blocks at many scales."""
    blocks = [np.zeros(32, np.float32)]
    halves = np.array([127, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, 63.5, -63.5, 3.5], np.float32)
    blocks.append(np.concatenate([halves, rng.integers(-126, 127, 20).astype(np.float32) + 0.5]))  # d = 1
    quarter = np.array([63.5, 0.25, -0.25, 0.75, -0.75, 1.25, 31.75, -31.75], np.float32)            # d = 0.5
    blocks.append(np.concatenate([quarter, rng.integers(-120, 120, 24).astype(np.float32) * 0.5 + 0.25]))
    neg = rng.uniform(-1, 1, 32).astype(np.float32)
    neg[3] = -7.0                                                                                   # negative max
    blocks.append(neg)
    for magnitude in (1e38, 3e36, 65504.0 * 127, 65520.0 * 127, 1e4, 1.0, 1e-4, 3e-6, 1e-7, 1e-20, 1e-30):
        x = (rng.uniform(-1, 1, 32) * magnitude).astype(np.float32)
        x[rng.integers(32)] = np.float32(magnitude) * (1 if rng.random() < 0.5 else -1)
        blocks.append(x)
    one = np.zeros(32, np.float32)
    one[31] = -1e-3
    blocks.append(one)
    blocks.append(np.full(32, 7.0, np.float32))
    blocks.append(np.full(32, -1 / 3, np.float32))
    while len(blocks) % 8:
        blocks.append(rng.standard_normal(32).astype(np.float32))
    edge = np.concatenate(blocks).reshape(-1, 256)
    scales = np.exp2(rng.integers(-20, 20, size=(64, 8, 1))).astype(np.float32)
    rand = (rng.standard_normal((64, 8, 32)).astype(np.float32) * scales).reshape(64, 256)
    return np.concatenate([edge, rand])


def test_q8_0_quantizer_is_bit_exact_with_gguf_py_on_edge_cases_and_random_blocks():
    x = _edge_rows(np.random.default_rng(3))
    with np.errstate(over="ignore"):
        assert np.array_equal(quantize_q8_0(x), gguf_py_q8_0(x))


def test_q8_0_quantizer_is_bit_exact_with_ggml_c_quantizer_on_edge_cases_and_random_blocks(ggml_q8_0):
    x = _edge_rows(np.random.default_rng(4))
    with np.errstate(over="ignore"):
        mine = quantize_q8_0(x)
    theirs = ggml_q8_0(x)
    bad = np.argwhere((mine != theirs).reshape(x.shape[0], -1, 34).any(axis=-1))
    assert not len(bad), f"blocks differ (row, block): {bad[:5].tolist()}"


def _just_below_half_block() -> np.ndarray:
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 127.0                                        # d = 1, 1/d = 1: x*id is x itself
    x[0, 1] = np.nextafter(np.float32(0.5), np.float32(0))  # 0.49999997: roundf gives 0
    x[0, 2] = -x[0, 1]
    return x


def test_q8_0_quantizer_rounds_the_float_just_below_one_half_to_zero_as_gguf_py_does():
    x = _just_below_half_block()
    assert np.array_equal(quantize_q8_0(x), gguf_py_q8_0(x))


def test_q8_0_quantizer_rounds_the_float_just_below_one_half_to_zero_as_ggml_does(ggml_q8_0):
    x = _just_below_half_block()
    assert np.array_equal(quantize_q8_0(x), ggml_q8_0(x))


def test_bf16_rounding_is_to_nearest_even_and_keeps_nan_and_inf():
    rng = np.random.default_rng(5)
    x = np.concatenate([
        rng.standard_normal(4096).astype(np.float32) * np.exp2(rng.integers(-100, 100, 4096)).astype(np.float32),
        # exact ties: 1 + 2**-8 -> 1 (even), 1 + 3 * 2**-8 -> 1 + 2**-6 (even), and their negatives
        np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), -(1 + 3 * 2 ** -8)], np.float32),
        np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, 0.0, -0.0, 1e-40, np.inf, -np.inf], np.float32),
    ])
    got = f32_to_bf16(x)
    assert np.array_equal(got, f32_to_bf16_reference(x))
    assert got[4096:4100].tolist() == [0x3F80, 0x3F82, 0xBF80, 0xBF82]
    nan = f32_to_bf16(np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(bf16_bits_to_f32(nan)).all()


@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16"])
def test_float_maps_round_trip_through_each_float_outtype(tmp_path, outtype):
    rng = np.random.default_rng(6)
    tensors = {}
    for layer in LAYERS:
        w = rng.standard_normal((48, 64)).astype(np.float32)
        w[0, :4] = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -9]  # bf16 ties and a near-tie
        w[1, :2] = [2.0 ** -20, 3e-8]                                         # f16 subnormals
        tensors[f"proj.{layer}.weight"] = w
        tensors[f"proj.{layer}.bias"] = rng.standard_normal(48).astype(np.float32)
    src = tmp_path / "maps.safetensors"
    save(src, tensors, {"split": "2", "layers": "2,3", "architecture": "llama"})
    out = tmp_path / "maps.gguf"
    convert(src, out, outtype=outtype)  # d_in 64: fine for float types
    g = read_gguf(out)
    for layer in LAYERS:
        w, b = tensors[f"proj.{layer}.weight"], tensors[f"proj.{layer}.bias"]
        info = g.tensors[fmt.weight_name(layer)]
        assert info.type == {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16}[outtype] and info.ne == (64, 48)
        raw = weight_raw(g, layer)
        if outtype == "f32":
            assert np.array_equal(raw.view(np.uint32).reshape(48, 64), w.view(np.uint32))
        elif outtype == "f16":
            assert np.array_equal(raw.view(np.uint16).reshape(48, 64), w.astype(np.float16).view(np.uint16))
        else:
            got = raw.view(np.uint16).reshape(48, 64)
            assert np.array_equal(got, f32_to_bf16_reference(w).reshape(48, 64))
            assert got[0, :3].tolist() == [0x3F80, 0x3F82, 0xBF80]
        assert np.array_equal(bias_values(g, layer).view(np.uint32), b.view(np.uint32))


def test_bias_is_written_f32_and_exact_from_every_source(tmp_path):
    folder = int8_source(tmp_path / "int8", d_out=128)
    convert(folder, tmp_path / "a.gguf")
    g = read_gguf(tmp_path / "a.gguf")
    for layer in LAYERS:
        assert np.array_equal(bias_values(g, layer), bf16_bits_to_f32(source_int8(folder, layer)[2]))
    for dtype in ("bf16", "f16", "f32"):
        src = float_source(tmp_path / f"{dtype}.safetensors", dtype=dtype)
        convert(src, tmp_path / f"{dtype}.gguf", outtype="q8_0")
        g = read_gguf(tmp_path / f"{dtype}.gguf")
        for layer in LAYERS:
            assert g.tensors[fmt.bias_name(layer)].ne == (64,)
            assert np.array_equal(bias_values(g, layer), source_float(src, layer)[1])


# ---------------------------------------------------------------------------------------------
# 2. the written file's contract, also read through gguf-py's reader


def _reader_fields(path: Path) -> dict:
    r = gguf.GGUFReader(path)
    return {name: (f.types, f.contents()) for name, f in r.fields.items()}, r


def _model_vocab_sha256(model: Path) -> str:
    f = gguf.GGUFReader(model).fields["tokenizer.ggml.tokens"]
    h = hashlib.sha256()
    for i in f.data:
        h.update(bytes(f.parts[i]) + b"\0")
    return h.hexdigest()


def test_the_written_gguf_has_the_contract_keys_with_their_types(qwen3_maps, models):
    _, out = qwen3_maps
    fields, _ = _reader_fields(out)
    expect = {
        "general.type": ([VT.STRING], "adapter"),
        "adapter.type": ([VT.STRING], "ridgefill"),
        "general.architecture": ([VT.STRING], "qwen3"),
        "general.name": ([VT.STRING], "synthetic maps"),
        "ridgefill.format_version": ([VT.UINT32], 1),
        "ridgefill.split": ([VT.UINT32], SPLIT),
        "ridgefill.tail_default": ([VT.UINT32], 4096),
        "ridgefill.model.n_layer": ([VT.UINT32], 4),
        "ridgefill.model.n_embd": ([VT.UINT32], D),
        "ridgefill.model.vocab_sha256": ([VT.STRING], _model_vocab_sha256(models["qwen3"])),
    }
    for key, (types, value) in expect.items():
        assert key in fields, key
        assert fields[key] == (types, value), key
    types, lam = fields["ridgefill.lambda"]
    assert types == [VT.FLOAT32] and np.float32(lam) == np.float32(0.03)
    types, layers = fields["ridgefill.layers"]
    assert types[0] == VT.ARRAY and layers == LAYERS
    # the project's own reading agrees, with lambda as the decimal it was written from
    meta = fmt.maps_meta(fmt.read_maps(out))
    assert (meta.architecture, meta.split, meta.layers, meta.lam, meta.tail_default) == ("qwen3", 2, LAYERS, 0.03, 4096)
    assert meta.model_vocab_sha256 == fmt.model_fingerprint(models["qwen3"]).vocab_sha256


def test_ridgefill_layers_is_an_array_of_u32_as_the_contract_says(qwen3_maps):
    _, out = qwen3_maps
    fields, _ = _reader_fields(out)
    assert fields["ridgefill.layers"][0] == [VT.ARRAY, VT.UINT32]


def test_without_model_no_fingerprint_is_written(tmp_path):
    out = tmp_path / "maps.gguf"
    convert(int8_source(tmp_path / "src", d_out=128, arch=None), out, arch="llama")
    fields, _ = _reader_fields(out)
    assert fields["general.architecture"][1] == "llama"
    assert not any(k.startswith("ridgefill.model.") for k in fields)


@pytest.mark.parametrize("outtype,qtype", [("q8_0", QT.Q8_0), ("f16", QT.F16), ("bf16", QT.BF16), ("f32", QT.F32)])
def test_tensor_names_and_ggml_shapes_are_d_in_by_d_out_for_gguf_py_too(tmp_path, outtype, qtype):
    src = int8_source(tmp_path / "src", d_out=128, d_in=256)
    out = tmp_path / "maps.gguf"
    convert(src, out, outtype=outtype)
    _, reader = _reader_fields(out)
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == {fmt.weight_name(x) for x in LAYERS} | {fmt.bias_name(x) for x in LAYERS}
    assert set(tensors) == {f"blk.{x}.rf_map.{k}" for x in LAYERS for k in ("weight", "bias")}
    for layer in LAYERS:
        w, b = tensors[f"blk.{layer}.rf_map.weight"], tensors[f"blk.{layer}.rf_map.bias"]
        assert (w.tensor_type, [int(v) for v in w.shape]) == (qtype, [256, 128])
        assert (b.tensor_type, [int(v) for v in b.shape]) == (QT.F32, [128])
        codes, scale, bias = source_int8(src, layer)
        expected = (codes.reshape(128, 2, 128).astype(np.float32)
                    * bf16_bits_to_f32(scale)[..., None]).reshape(128, 256)
        if qtype == QT.Q8_0:
            got = gguf.quants.dequantize(np.asarray(w.data), QT.Q8_0).reshape(128, 256)
        elif qtype == QT.BF16:
            got = bf16_bits_to_f32(np.asarray(w.data).view(np.uint16)).reshape(128, 256)
        else:
            got = np.asarray(w.data).astype(np.float32).reshape(128, 256)
        tol = {QT.Q8_0: 0, QT.F32: 0, QT.F16: 2 ** -11, QT.BF16: 2 ** -8}[qtype]
        assert np.all(np.abs(got - expected) <= tol * np.abs(expected) + 1e-30)
        assert np.array_equal(np.asarray(b.data, dtype=np.float32), bf16_bits_to_f32(bias))


# ---------------------------------------------------------------------------------------------
# 3. refused inputs: ConvertError naming the file, the tensor and the problem; nothing left behind


def _drop_layer_file(tmp, models):
    src = int8_source(tmp / "src")
    (src / "proj8.L3.safetensors").unlink()
    return src, {}, ["ridgefill.json", "proj8.L3.safetensors", "missing"]


def _codes_vs_scale(tmp, models):
    src = int8_source(tmp / "src")
    edit_safetensors(src / "proj8.L3.safetensors",
                     lambda t, bf: t.__setitem__("proj.3.scale", t["proj.3.scale"][:, :1].copy()))
    return src, {}, ["proj8.L3.safetensors", "proj.3.scale", "shape", "[256, 2]"]


def _int8_bias_shape(tmp, models):
    src = int8_source(tmp / "src")
    edit_safetensors(src / "proj8.L2.safetensors",
                     lambda t, bf: t.__setitem__("proj.2.bias", t["proj.2.bias"][:200].copy()))
    return src, {}, ["proj8.L2.safetensors", "proj.2.bias", "shape", "[256]"]


def _weight_vs_bias(tmp, models):
    path = float_source(tmp / "maps.safetensors")
    edit_safetensors(path, lambda t, bf: t.__setitem__("proj.3.bias", t["proj.3.bias"][:60].copy()))
    return path, {}, ["maps.safetensors", "proj.3.bias", "shape", "[64]"]


def _int8_d_in_not_128(tmp, models):
    src = int8_source(tmp / "src")

    def edit(t, bf):
        t["proj.2.codes"] = t["proj.2.codes"][:, :160].copy()
    edit_safetensors(src / "proj8.L2.safetensors", edit)
    return src, {}, ["proj8.L2.safetensors", "proj.2.codes", "160", "128"]


def _float_d_in_not_32(tmp, models):
    path = float_source(tmp / "maps.safetensors", d_out=48, d_in=48)
    return path, {}, ["maps.safetensors", "48", "multiple of 32"]


def _set_value(path: Path, name: str, index, value: float):
    def edit(t, bf):
        arr = t[name].copy()
        if name in bf:
            arr[index] = f32_to_bf16(np.array([value], np.float32))[0]
        else:
            arr[index] = value
        t[name] = arr
    edit_safetensors(path, edit)


def _nan_scale(tmp, models):
    src = int8_source(tmp / "src")
    _set_value(src / "proj8.L3.safetensors", "proj.3.scale", (5, 1), np.nan)  # the second layer: mid-write
    return src, {}, ["proj8.L3.safetensors", "proj.3.scale", "NaN/Inf", "[5, 1]"]


def _inf_int8_bias(tmp, models):
    src = int8_source(tmp / "src")
    _set_value(src / "proj8.L2.safetensors", "proj.2.bias", 7, -np.inf)
    return src, {}, ["proj8.L2.safetensors", "proj.2.bias", "NaN/Inf", "[7]"]


def _nan_float_weight(tmp, models):
    path = float_source(tmp / "maps.safetensors", dtype="f32")
    _set_value(path, "proj.3.weight", (10, 20), np.nan)
    return path, {}, ["maps.safetensors", "proj.3.weight", "NaN/Inf", "[10, 20]"]


def _inf_bf16_weight(tmp, models):
    path = float_source(tmp / "maps.safetensors", dtype="bf16")
    _set_value(path, "proj.2.weight", (1, 2), np.inf)
    return path, {"outtype": "f16"}, ["maps.safetensors", "proj.2.weight", "NaN/Inf"]


def _inf_f16_bias(tmp, models):
    path = float_source(tmp / "maps.safetensors", dtype="f16")
    _set_value(path, "proj.3.bias", 3, np.inf)
    return path, {}, ["maps.safetensors", "proj.3.bias", "NaN/Inf", "[3]"]


def _codes_as(dtype):
    def make(tmp, models):
        src = int8_source(tmp / "src")
        edit_safetensors(src / "proj8.L2.safetensors",
                         lambda t, bf: t.__setitem__("proj.2.codes", t["proj.2.codes"].astype(dtype)))
        name = {np.int16: "I16", np.float32: "F32"}[dtype]
        return src, {}, ["proj8.L2.safetensors", "proj.2.codes", name, "I8"]
    return make


def _float_weight_as_int8(tmp, models):
    path = float_source(tmp / "maps.safetensors")
    edit_safetensors(path, lambda t, bf: t.__setitem__("proj.2.weight", np.ones((64, 64), np.int8)))
    return path, {}, ["maps.safetensors", "proj.2.weight", "I8", "BF16, F16, F32"]


def _scale_as_f32(tmp, models):
    src = int8_source(tmp / "src")

    def edit(t, bf):
        t["proj.2.scale"] = bf16_bits_to_f32(t["proj.2.scale"])
        bf.remove("proj.2.scale")
    edit_safetensors(src / "proj8.L2.safetensors", edit)
    return src, {}, ["proj8.L2.safetensors", "proj.2.scale", "F32", "BF16"]


def _split_outside_model(tmp, models):
    src = int8_source(tmp / "src", split=4, layers=[4], arch=None)  # the model has layers 0..3
    return src, {"model": models["qwen3"]}, ["qwen3-256.gguf", "split 4", "outside", "1..3"]


def _layer_outside_model(tmp, models):
    src = int8_source(tmp / "src", split=2, layers=[2, 3, 4], arch=None)
    return src, {"model": models["qwen3"]}, ["qwen3-256.gguf", "layer 4", "0..3"]


def _layers_below_split(tmp, models):
    src = int8_source(tmp / "src", split=3, layers=[2, 3])
    return src, {}, ["ridgefill.json", "layer 2", "below the split 3"]


def _layers_not_increasing(tmp, models):
    path = float_source(tmp / "maps.safetensors", layers=[3, 2])
    return path, {}, ["maps.safetensors", "strictly increasing"]


def _width_vs_model(tmp, models):
    src = int8_source(tmp / "src", d_out=128, arch=None)  # the model is 256 wide
    return src, {"model": models["qwen3"]}, ["qwen3-256.gguf", "128x128", "256 wide"]


def _no_config(tmp, models):
    src = int8_source(tmp / "src")
    (src / "ridgefill.json").unlink()
    return src, {}, [str(src), "ridgefill.json"]


def _bad_json(tmp, models):
    src = int8_source(tmp / "src")
    (src / "ridgefill.json").write_text("{split: 2")
    return src, {}, ["ridgefill.json", "JSON"]


def _no_key_in_config(key):
    def make(tmp, models):
        src = int8_source(tmp / "src")
        cfg = json.loads((src / "ridgefill.json").read_text())
        del cfg[key]
        (src / "ridgefill.json").write_text(json.dumps(cfg))
        return src, {}, ["ridgefill.json", f"'{key}'", "missing"]
    return make


def _no_key_in_metadata(key):
    def make(tmp, models):
        path = float_source(tmp / "maps.safetensors")
        st = SafetensorsFile(path)
        tensors = {n: np.array(st.get(n)) for n in st.entries}
        md = {k: v for k, v in st.metadata.items() if k != key}
        del st
        save(path, tensors, md)
        return path, {}, ["maps.safetensors", f"'{key}'"]
    return make


def _unknown_arch(tmp, models):
    src = int8_source(tmp / "src", arch=None)
    return src, {}, ["architecture", "--model", "--arch"]


def _arch_contradicts_model(tmp, models):
    src = int8_source(tmp / "src", arch=None)
    return src, {"model": models["qwen3"], "arch": "llama"}, ["--arch llama", "qwen3"]


def _not_safetensors(tmp, models):
    path = tmp / "maps.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    return path, {}, ["maps.safetensors", "safetensors"]


def _truncated_layer_file(tmp, models):
    src = int8_source(tmp / "src")
    p = src / "proj8.L3.safetensors"
    p.write_bytes(p.read_bytes()[:-1000])
    return src, {}, ["proj8.L3.safetensors", "proj.3", "truncated"]


BAD_INPUTS = {
    "missing-layer-file": _drop_layer_file,
    "codes-vs-scale-shape": _codes_vs_scale,
    "int8-bias-shape": _int8_bias_shape,
    "weight-vs-bias-shape": _weight_vs_bias,
    "int8-d_in-not-multiple-of-128": _int8_d_in_not_128,
    "float-d_in-not-multiple-of-32": _float_d_in_not_32,
    "nan-in-scale": _nan_scale,
    "inf-in-int8-bias": _inf_int8_bias,
    "nan-in-f32-weight": _nan_float_weight,
    "inf-in-bf16-weight": _inf_bf16_weight,
    "inf-in-f16-bias": _inf_f16_bias,
    "codes-stored-as-int16": _codes_as(np.int16),
    "codes-stored-as-float32": _codes_as(np.float32),
    "scale-stored-as-f32": _scale_as_f32,
    "float-weight-stored-as-int8": _float_weight_as_int8,
    "split-outside-model": _split_outside_model,
    "layer-outside-model": _layer_outside_model,
    "layers-below-split": _layers_below_split,
    "layers-not-increasing": _layers_not_increasing,
    "width-not-model-n_embd": _width_vs_model,
    "no-ridgefill-json": _no_config,
    "ridgefill-json-not-json": _bad_json,
    "no-split-in-config": _no_key_in_config("split"),
    "no-layers-in-config": _no_key_in_config("layers"),
    "no-split-in-metadata": _no_key_in_metadata("split"),
    "no-layers-in-metadata": _no_key_in_metadata("layers"),
    "unknown-architecture": _unknown_arch,
    "arch-contradicts-model": _arch_contradicts_model,
    "not-a-safetensors-file": _not_safetensors,
    "truncated-layer-file": _truncated_layer_file,
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_a_bad_input_is_refused_by_name_and_leaves_nothing_behind(tmp_path, models, case):
    src, kwargs, needles = BAD_INPUTS[case](tmp_path, models)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "maps.gguf"
    with pytest.raises(ConvertError) as e:
        convert(src, out, **kwargs)
    for needle in needles:
        assert needle in str(e.value), f"{needle!r} not in {str(e.value)!r}"
    assert list(out_dir.iterdir()) == []

    args = ["convert", src, "-o", out]
    for k, v in kwargs.items():
        args += [f"--{k}", v]
    result = cli(*args)
    assert_clean_failure(result, *needles)
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("case,tensor", [
    pytest.param("float-d_in-not-multiple-of-32", "proj.2.weight"),
    pytest.param("width-not-model-n_embd", "proj.2.codes"),
])
def test_errors_about_a_maps_width_name_the_source_file_and_the_tensor(tmp_path, models, case, tensor):
    src, kwargs, _ = BAD_INPUTS[case](tmp_path, models)
    with pytest.raises(ConvertError) as e:
        convert(src, tmp_path / "maps.gguf", **kwargs)
    assert tensor in str(e.value) and src.name in str(e.value)


def _byte_size_mismatch(path: Path) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["proj.2.weight"]["shape"] = [64, 32]  # the offsets still span 64 x 64 f32
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def _no_data_offsets(path: Path) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    del header["proj.2.weight"]["data_offsets"]
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


@pytest.mark.parametrize("corrupt", [_byte_size_mismatch, _no_data_offsets], ids=["byte-size", "no-data-offsets"])
def test_a_corrupt_safetensors_header_is_a_convert_error_not_a_crash(tmp_path, corrupt):
    path = float_source(tmp_path / "maps.safetensors", dtype="f32")
    corrupt(path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = cli("convert", path, "-o", out_dir / "maps.gguf")
    assert list(out_dir.iterdir()) == []
    assert_clean_failure(result, "maps.safetensors", "proj.2.weight")
    with pytest.raises(ConvertError):
        convert(path, out_dir / "maps.gguf")


def test_int8_maps_that_q8_0_cannot_hold_are_refused_rather_than_written_as_inf(tmp_path):
    src, _ = _special_scale_folder(tmp_path / "src", big_codes=127)  # 127 * 2**17 / 127 = 131072 > 65504
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with np.errstate(over="ignore", invalid="ignore"):
        try:
            convert(src, out_dir / "maps.gguf")
        except ConvertError:
            assert list(out_dir.iterdir()) == []
            return
        d, _ = split_q8_0(weight_raw(read_gguf(out_dir / "maps.gguf"), 2), 64, 512)
    assert np.isfinite(d).all(), "Q8_0 scales written as inf"


def test_float_maps_that_f16_cannot_hold_are_refused_rather_than_written_as_inf(tmp_path):
    tensors = {"proj.2.weight": np.eye(64, dtype=np.float32) * 1e5, "proj.2.bias": np.zeros(64, np.float32)}
    src = tmp_path / "maps.safetensors"
    save(src, tensors, {"split": "2", "layers": "[2]", "architecture": "llama"})
    out = tmp_path / "maps.gguf"
    with np.errstate(over="ignore"):
        try:
            convert(src, out, outtype="f16")
        except ConvertError:
            return
    w = weight_raw(read_gguf(out), 2).view(np.float16)
    assert np.isfinite(w).all(), "F16 weights written as inf"


def test_an_existing_output_is_kept_without_force_and_replaced_with_it(tmp_path):
    src = int8_source(tmp_path / "src", d_out=128)
    out_dir = tmp_path / "out"
    out = out_dir / "maps.gguf"
    convert(src, out)
    before = out.read_bytes()

    with pytest.raises(ConvertError, match="--force"):
        convert(src, out, outtype="f16")
    assert_same_bytes(out.read_bytes(), before)
    result = cli("convert", src, "-o", out, "--outtype", "f16")
    assert_clean_failure(result, "maps.gguf", "--force")
    assert_same_bytes(out.read_bytes(), before)

    result = cli("convert", src, "-o", out, "--outtype", "f16", "--force")
    assert result.exit_code == 0, result.output
    assert out.read_bytes() != before
    assert read_gguf(out).tensors[fmt.weight_name(2)].type == QT.F16
    assert [p.name for p in out_dir.iterdir()] == ["maps.gguf"]

    # a refused overwrite with --force keeps the old file too
    _set_value(src / "proj8.L3.safetensors", "proj.3.scale", (0, 0), np.inf)
    after_force = out.read_bytes()
    with pytest.raises(ConvertError, match="NaN/Inf"):
        convert(src, out, force=True)
    assert_same_bytes(out.read_bytes(), after_force)
    assert [p.name for p in out_dir.iterdir()] == ["maps.gguf"]


def test_the_convert_command_reports_what_it_wrote(tmp_path):
    src = int8_source(tmp_path / "src", d_out=128)
    result = cli("convert", src, "-o", tmp_path / "maps.gguf", "-q")
    assert result.exit_code == 0, result.output
    assert "2 maps 128x128 as Q8_0 from the int8 folder" in result.output
    assert "1024 of 1024 blocks repacked exactly, 0 requantized" in result.output


# ---------------------------------------------------------------------------------------------
# 4. inspect and verify on broken files; inspect's reports


def _bad_maps_file(kind: str, good: Path, tmp: Path) -> tuple[Path, str]:
    path = tmp / f"{kind}.gguf"
    data = good.read_bytes()
    if kind == "half":
        path.write_bytes(data[:len(data) // 2])
        return path, "truncated"
    if kind == "cut-in-header":
        path.write_bytes(data[:120])
        return path, "truncated"
    if kind == "not-gguf":
        path.write_bytes(b"this is a text file, not a model\n" * 10)
        return path, "not a GGUF file"
    if kind == "empty":
        path.write_bytes(b"")
        return path, "not a GGUF file"
    if kind == "missing":
        return path, "cannot open"
    raise AssertionError(kind)


BAD_FILES = ["half", "cut-in-header", "not-gguf", "empty", "missing"]


@pytest.mark.parametrize("kind", BAD_FILES)
def test_inspect_refuses_a_broken_file_with_a_clear_error(tmp_path, qwen3_maps, kind):
    path, words = _bad_maps_file(kind, qwen3_maps[1], tmp_path)
    for args in (["inspect", path], ["inspect", "--json", path]):
        assert_clean_failure(cli(*args), path.name, words)
    with pytest.raises(GGUFFormatError):
        inspect_maps(path)


@pytest.mark.parametrize("kind", BAD_FILES)
def test_verify_refuses_a_broken_maps_file_with_a_clear_error(tmp_path, qwen3_maps, models, kind):
    path, words = _bad_maps_file(kind, qwen3_maps[1], tmp_path)
    result = cli("verify", path, models["qwen3"])
    assert_clean_failure(result, path.name, words)
    assert "fits" not in result.output


@pytest.mark.parametrize("kind", ["half", "not-gguf"])
def test_verify_refuses_a_broken_model_file_with_a_clear_error(tmp_path, qwen3_maps, models, kind):
    if kind == "half":
        path = tmp_path / "model.gguf"
        data = models["qwen3"].read_bytes()
        path.write_bytes(data[:len(data) // 2])
    else:
        path = tmp_path / "model.gguf"
        path.write_text("not a model")
    assert_clean_failure(cli("verify", qwen3_maps[1], path), "model", path.name)


def test_inspect_json_gives_each_layers_type_shape_norm_and_max(qwen3_maps):
    src, out = qwen3_maps
    result = cli("inspect", "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["errors"] == [] and report["adapter_type"] == "ridgefill" and report["format_version"] == 1
    assert report["metadata"]["split"] == SPLIT and report["metadata"]["layers"] == LAYERS
    assert report["metadata"]["model_n_embd"] == D and report["file_bytes"] == out.stat().st_size
    assert report["n_layers"] == len(LAYERS) and [x["layer"] for x in report["layers"]] == LAYERS
    for row in report["layers"]:
        codes, scale, bias = source_int8(src, row["layer"])
        w = (codes.reshape(D, 2, 128).astype(np.float32) * bf16_bits_to_f32(scale)[..., None]).reshape(D, D)
        assert (row["type"], row["d_in"], row["d_out"]) == ("Q8_0", D, D)
        assert row["weight_max_abs"] == float(np.abs(w).max())
        assert row["weight_norm"] == pytest.approx(float(np.linalg.norm(w.astype(np.float64))), rel=1e-5)
        assert row["bias_norm"] == pytest.approx(float(np.linalg.norm(bf16_bits_to_f32(bias).astype(np.float64))),
                                                 rel=1e-5)
        assert row["bytes"] == D * D // 32 * 34 + 4 * D


def test_inspect_text_summary_mentions_split_layer_count_and_size(qwen3_maps):
    _, out = qwen3_maps
    result = cli("inspect", out)
    assert result.exit_code == 0, result.output
    text = result.output
    assert f"split {SPLIT}" in text
    assert f"{len(LAYERS)} mapped layer(s) [2-3]" in text
    assert f"{out.stat().st_size / 2**20:.1f} MiB" in text
    assert "qwen3" in text and "Q8_0" in text and "256x256" in text
    assert summary_text(inspect_maps(out)) == text.rstrip("\n")
    no_stats = cli("inspect", "--no-stats", out)
    assert no_stats.exit_code == 0 and "max|w|" not in no_stats.output and f"split {SPLIT}" in no_stats.output


# ---------------------------------------------------------------------------------------------
# 5. verify against random-weight models


def test_verify_accepts_maps_made_for_the_model(qwen3_maps, models):
    _, out = qwen3_maps
    result = cli("verify", out, models["qwen3"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "fits" in lines[0] and "qwen3, 4 layers, n_embd 256" in lines[0]


def test_verify_accepts_float_maps_for_a_tiny_model_without_a_fingerprint(tmp_path, models):
    src = float_source(tmp_path / "maps.safetensors", d_out=128, layers=[1], split=1, arch="llama")
    out = tmp_path / "maps.gguf"
    convert(src, out)
    result = cli("verify", out, models["llama"])
    assert result.exit_code == 0 and "fits" in result.output, result.output


@pytest.mark.parametrize("kind", ["nan-scale", "inf-bias"])
def test_verify_names_a_non_finite_value_in_a_map_or_a_bias(tmp_path, qwen3_maps, models, kind):
    _, out = qwen3_maps
    tensor = fmt.weight_name(3) if kind == "nan-scale" else fmt.bias_name(2)
    raw = bytes.fromhex("007e") if kind == "nan-scale" else np.float32(-np.inf).tobytes()
    data = bytearray(out.read_bytes())
    start = read_gguf(out).tensors[tensor].offset + (34 if kind == "nan-scale" else 0)
    data[start:start + len(raw)] = raw
    bad = tmp_path / f"{kind}.gguf"
    bad.write_bytes(bytes(data))
    result = cli("verify", bad, models["qwen3"])
    where = "(NaN) at element 32" if kind == "nan-scale" else "(Inf) at element 0"
    assert_clean_failure(result, f"{bad}: tensor {tensor} holds a non-finite value {where}")
    assert "fits" not in result.output


def test_verify_reports_a_change_that_keeps_every_value_finite_by_the_tensor_data_checksum(
        tmp_path, qwen3_maps, models):
    _, out = qwen3_maps
    assert "fits" in cli("verify", out, models["qwen3"]).output
    tensor = fmt.weight_name(3)
    data = bytearray(out.read_bytes())
    data[read_gguf(out).tensors[tensor].offset + 40] ^= 0x01  # one int8 quant: still finite, no value check sees it
    bad = tmp_path / "one-byte.gguf"
    bad.write_bytes(bytes(data))
    result = cli("verify", bad, models["qwen3"])
    assert_clean_failure(result, "do not match ridgefill.tensor_data_sha256")
    assert "the file changed after it was written" in result.output and "fits" not in result.output


def test_verify_refuses_maps_that_leave_out_a_late_layer(tmp_path, models):
    src = float_source(tmp_path / "gap.safetensors", d_out=256, layers=[2], split=1, arch="qwen3")
    out = tmp_path / "gap.gguf"
    convert(src, out)
    result = cli("verify", out, models["qwen3"])  # 4 layers: split 1 needs maps for 2 and 3
    assert_clean_failure(result, "ridgefill.layers leaves out late layers [3]: every layer after the split 1 needs a map")


def test_verify_lists_one_line_per_problem_for_maps_made_for_another_model(qwen3_maps, models):
    _, out = qwen3_maps
    result = cli("verify", out, models["llama"])  # llama, 2 layers, n_embd 128
    assert_clean_failure(result)
    lines = result.output.strip().splitlines()
    expected = [
        "general.architecture is 'qwen3', the model is 'llama'",
        "ridgefill.model.n_embd is 256, the model has 128",
        "ridgefill.model.n_layer is 4, the model has 2",
        "ridgefill.split 2 is outside the model's layers 1..1",
        "ridgefill.layers holds layer 3, the model has layers 0..1",
        "a map is 256x256 (d_out x d_in), the model's residual stream is 128 wide (tensor blk.2.rf_map.weight and 1 more)",
    ]
    assert sorted(lines) == sorted(f"{out}: {e}" for e in expected), result.output
    assert not any("fits" in x for x in lines)


def test_verify_only_warns_when_the_vocabulary_alone_differs(qwen3_maps, models):
    _, out = qwen3_maps
    result = cli("verify", out, models["qwen3-other-vocab"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("warning:") and "vocab_sha256" in lines[0]
    assert "fits" in lines[1]
    problems = fmt.check_maps(fmt.read_maps(out), fmt.model_fingerprint(models["qwen3-other-vocab"]))
    assert problems.ok and len(problems.warnings) == 1


def test_verify_refuses_an_adapter_that_is_not_ridgefill_by_name(tmp_path, models):
    path = tmp_path / "lora.gguf"
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 16.0)
    w.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((8, D), np.float32))
    w.add_tensor("blk.0.attn_q.weight.lora_b", np.zeros((D, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    result = cli("verify", path, models["qwen3"])
    assert_clean_failure(result)
    assert result.output.strip().splitlines() == [f"{path}: adapter.type is 'lora', expected 'ridgefill'"]
    insp = cli("inspect", path)
    assert insp.exit_code != 0 and "adapter.type is 'lora'" in insp.output
