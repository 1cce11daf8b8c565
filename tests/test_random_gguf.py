"""Random-weight GGUFs: deterministic, well-formed, and loadable by the vendored llama.cpp."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import assert_same_bytes
from ridgefill_gguf.paths import project_root
from ridgefill_gguf.random_gguf import (
    SUPPORTED_ARCHS, ModelShape, default_vocab, main, read_gguf_metadata, tensor_specs, tiny_shape,
    tokenizer_kv, write_random_model,
)

LIB_DIR = project_root() / "build" / "upstream" / "bin"
needs_llama = pytest.mark.skipif(
    not (LIB_DIR / "libllama.so").exists() or importlib.util.find_spec("llama_cpp") is None,
    reason=f"needs the upstream llama.cpp build ({LIB_DIR / 'libllama.so'}) and llama-cpp-python",
)

PROMPT = "The quick brown fox jumps over the lazy dog. Hello world, 123!"

# runs in a subprocess: llama_cpp reads LLAMA_CPP_LIB_PATH when it is first imported
_PROBE = r"""
import json, sys
import numpy as np
import llama_cpp
req = json.loads(sys.argv[1])
results = []
for m in req["models"]:
    llm = llama_cpp.Llama(model_path=m["path"], n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    tokenized = [llm.tokenize(t.encode(), add_bos=False, special=False) for t in m["texts"]]
    toks = llm.tokenize(req["prompt"].encode(), add_bos=False)
    llm.eval(toks)
    logits = np.asarray(llm.scores[:len(toks)], dtype=np.float64)
    results.append({
        "n_vocab": llm.n_vocab(),
        "n_tokens": len(toks),
        "finite": bool(np.isfinite(logits).all()),
        "min_spread_in_row": float(logits.std(axis=1).min()),
        "min_change_between_positions": float(np.abs(np.diff(logits, axis=0)).max(axis=1).min()),
        "tokenized": tokenized,
    })
    llm.close()
print(json.dumps(results))
"""


def probe(models: list[dict]) -> list[dict]:
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(LIB_DIR)}
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps({"models": models, "prompt": PROMPT})],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def vocab_cases(vocab: Path) -> tuple[list[str], list[list[int]]]:
    """The tokenizer test cases llama.cpp ships next to each vocab file (format of test-tokenizer-0)."""
    texts = vocab.with_name(vocab.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    if texts[-1] == "":
        texts.pop()
    ids = [[int(t) for t in line.split()]
           for line in vocab.with_name(vocab.name + ".out").read_text(encoding="utf-8").splitlines()]
    assert len(texts) == len(ids)
    return texts, ids


def assert_runs_sanely(result: dict) -> None:
    assert result["n_tokens"] > 5
    assert result["finite"], "logits contain NaN or inf"
    assert result["min_spread_in_row"] > 1e-4, "all logits of a position are equal"
    assert result["min_change_between_positions"] > 1e-4, "two positions gave the same logits"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("tiny")
    return {arch: write_random_model(out / f"{arch}.gguf", tiny_shape(arch)) for arch in SUPPORTED_ARCHS}


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_the_same_seed_gives_identical_bytes_and_another_seed_other_weights(arch, tiny_models, tmp_path):
    again = write_random_model(tmp_path / "again.gguf", tiny_shape(arch), seed=0)
    other = write_random_model(tmp_path / "other.gguf", tiny_shape(arch), seed=1)
    first = tiny_models[arch].read_bytes()
    assert_same_bytes(again.read_bytes(), first)
    other_bytes = other.read_bytes()
    assert len(other_bytes) == len(first) and other_bytes != first
    assert not list(tmp_path.glob(".*.tmp")), "temporary file left behind"


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_metadata_carries_the_shape_and_the_vocab_files_whole_tokenizer(arch, tiny_models):
    shape = tiny_shape(arch)
    meta = {k: v[1] for k, v in read_gguf_metadata(tiny_models[arch]).items()}
    assert meta["general.architecture"] == arch.encode()
    assert meta["general.name"] == f"ridgefill-random-{arch}".encode()
    assert meta["general.file_type"] == gguf.LlamaFileType.ALL_F32
    expected = {"context_length": shape.n_ctx_train, "embedding_length": shape.n_embd,
                "block_count": shape.n_layer, "feed_forward_length": shape.n_ff,
                "attention.head_count": shape.n_head, "attention.head_count_kv": shape.n_head_kv,
                "attention.key_length": shape.head_dim, "attention.value_length": shape.head_dim,
                "rope.dimension_count": shape.rot_dims}
    for key, value in expected.items():
        assert meta[f"{arch}.{key}"] == value, key
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(shape.rms_eps)
    assert meta[f"{arch}.rope.freq_base"] == pytest.approx(shape.rope_theta)

    tok = {k: v[1] for k, v in tokenizer_kv(default_vocab(arch)).items()}
    assert {k: v for k, v in meta.items() if k.startswith("tokenizer.")} == tok
    assert meta[f"{arch}.vocab_size"] == len(tok["tokenizer.ggml.tokens"])


def test_qwen35_metadata_has_the_gated_deltanet_and_mrope_keys(tiny_models):
    s = tiny_shape("qwen35")
    meta = {k: v[1] for k, v in read_gguf_metadata(tiny_models["qwen35"]).items()}
    assert meta["qwen35.rope.dimension_sections"] == list(s.rope_sections)
    assert meta["qwen35.full_attention_interval"] == s.full_attention_interval
    assert (meta["qwen35.ssm.conv_kernel"], meta["qwen35.ssm.state_size"], meta["qwen35.ssm.group_count"],
            meta["qwen35.ssm.time_step_rank"], meta["qwen35.ssm.inner_size"]) == \
        (s.ssm_d_conv, s.ssm_d_state, s.ssm_n_group, s.ssm_dt_rank, s.ssm_d_state * s.ssm_dt_rank)


def test_gguf_reader_reads_back_a_q8_0_qwen35_with_the_planned_tensors(tmp_path):
    shape = tiny_shape("qwen35")
    path = write_random_model(tmp_path / "q.gguf", shape, dtype="q8_0")
    reader = gguf.GGUFReader(path)  # slow on 150k-token vocabularies, so read back only this one
    assert reader.fields["general.architecture"].contents() == "qwen35"
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    fast = read_gguf_metadata(path)  # the quick reader the other tests use must agree
    assert set(reader.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"} == set(fast)
    assert reader.fields["qwen35.rope.dimension_sections"].contents() == fast["qwen35.rope.dimension_sections"][1]
    assert reader.fields["tokenizer.ggml.tokens"].contents() == \
        [t.decode() for t in fast["tokenizer.ggml.tokens"][1]]

    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    specs = tensor_specs(shape, n_vocab)
    assert [t.name for t in reader.tensors] == [s.name for s in specs]
    for t, spec in zip(reader.tensors, specs):
        assert tuple(t.shape.tolist()) == tuple(reversed(spec.shape)), t.name  # ggml ne order
        want = gguf.GGMLQuantizationType.F32 if spec.float_only else gguf.GGMLQuantizationType.Q8_0
        assert t.tensor_type == want, t.name
    # one recurrent (Gated DeltaNet) layer and the attention layer closing each interval
    names = {t.name for t in reader.tensors}
    assert {"blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.attn_qkv.weight", "blk.0.post_attention_norm.weight"} <= names
    assert {"blk.3.attn_q.weight", "blk.3.attn_q_norm.weight"} <= names and "blk.3.ssm_a" not in names
    q = next(t for t in reader.tensors if t.name == "blk.3.attn_q.weight")
    assert q.shape.tolist() == [shape.n_embd, 2 * shape.n_head * shape.head_dim]  # query + output gate


@needs_llama
def test_each_architecture_loads_in_llama_cpp_tokenizes_real_text_and_gives_finite_logits(tiny_models):
    models = []
    for arch in SUPPORTED_ARCHS:
        texts, _ = vocab_cases(default_vocab(arch))
        models.append({"path": str(tiny_models[arch]), "texts": texts})
    for arch, model, result in zip(SUPPORTED_ARCHS, models, probe(models)):
        assert_runs_sanely(result)
        assert result["n_vocab"] == len(tokenizer_kv(default_vocab(arch))["tokenizer.ggml.tokens"][1])
        _, expected = vocab_cases(default_vocab(arch))
        assert result["tokenized"] == expected, f"{arch}: tokenization differs from llama.cpp's vocab tests"


@needs_llama
@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_f16_and_q8_0_models_of_each_architecture_load_and_give_finite_logits(dtype, tmp_path):
    models = [{"path": str(write_random_model(tmp_path / f"{arch}.gguf", tiny_shape(arch), dtype=dtype)),
               "texts": []} for arch in SUPPORTED_ARCHS]
    for result in probe(models):
        assert_runs_sanely(result)


@needs_llama
def test_a_larger_n_vocab_pads_the_tokenizer_and_a_tied_model_still_loads(tmp_path):
    base = tiny_shape("llama")
    n_tok = len(tokenizer_kv(default_vocab("llama"))["tokenizer.ggml.tokens"][1])
    shape = dataclasses.replace(base, n_vocab=n_tok + 100, tie_embeddings=True)
    path = write_random_model(tmp_path / "padded.gguf", shape)
    meta = read_gguf_metadata(path)
    assert meta["tokenizer.ggml.tokens"][1][-1] == f"[PAD{n_tok + 99}]".encode()
    assert "output.weight" not in {s.name for s in tensor_specs(shape, n_tok + 100)}
    (result,) = probe([{"path": str(path), "texts": ["Hello world"]}])
    assert_runs_sanely(result)
    assert result["n_vocab"] == n_tok + 100
    assert result["tokenized"] == [[9906, 1917]]


def test_inconsistent_shapes_and_unknown_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="n_head \\* head_dim"):
        write_random_model(tmp_path / "x.gguf", dataclasses.replace(tiny_shape("qwen2"), head_dim=32))
    with pytest.raises(ValueError, match="arch"):
        tiny_shape("gpt2")
    with pytest.raises(ValueError, match="dtype"):
        write_random_model(tmp_path / "x.gguf", tiny_shape("llama"), dtype="q4_0")
    with pytest.raises(ValueError, match="rope_sections"):
        ModelShape(**{**dataclasses.asdict(tiny_shape("qwen35")), "rope_sections": (8, 8, 8, 0)}).validate()
    assert not list(tmp_path.iterdir())


def test_command_line_writes_the_requested_model_and_says_what_it_wrote(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    main(["--arch", "qwen3", "-o", str(out), "--dtype", "f16", "--seed", "3", "--layers", "3", "--embd", "128"])
    printed = capsys.readouterr().out
    assert str(out) in printed and "qwen3" in printed and "f16" in printed
    meta = read_gguf_metadata(out)
    assert meta["qwen3.block_count"][1] == 3 and meta["qwen3.embedding_length"][1] == 128
    assert meta["general.file_type"][1] == gguf.LlamaFileType.MOSTLY_F16


def test_real_model_presets_have_the_published_parameter_counts():
    import math

    from ridgefill_gguf.random_gguf import REAL_SHAPES, tensor_specs

    # the 27B hybrid: the 27B of its name (its vocabulary padded to 248,320 rows as the preset records);
    # Qwen3-Next with all 512 of its experts: the 79.67 B llama.cpp prints for the real model; Gemma-3-12B's text
    # model (11.77 B, the 12.2 B of its name less the vision tower) and Gemma-3-270M's 268 M
    published = {"qwen3-8b": 8.19e9, "llama-3.1-8b": 8.03e9, "qwen35-27b": 27e9, "qwen3next-80b-e64": 79.67e9,
                 "gemma3-12b": 11.77e9, "gemma3-270m": 268e6}
    for key, shape in REAL_SHAPES.items():
        shape.validate()
        if key == "qwen3next-80b-e64":
            shape = dataclasses.replace(shape, n_expert=512)
        n = sum(math.prod(t.shape) for t in tensor_specs(shape, shape.n_vocab))
        assert abs(n - published[key]) / published[key] < 0.01, (key, n)


def test_the_k_quant_encoders_write_blocks_that_gguf_py_decodes_close_to_the_input():
    from ridgefill_gguf.kquants import quantize_q4_k, quantize_q6_k

    x = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    for encode, qt, tolerance in ((quantize_q4_k, gguf.GGMLQuantizationType.Q4_K, 0.1),
                                  (quantize_q6_k, gguf.GGMLQuantizationType.Q6_K, 0.03)):
        blocks = encode(x)
        assert blocks.shape == (12, gguf.GGML_QUANT_SIZES[qt][1])
        y = gguf.quants.dequantize(blocks.reshape(6, -1), qt)
        assert np.abs(y - x).mean() / np.abs(x).mean() < tolerance, qt.name


@needs_llama
def test_a_q4_k_m_model_has_llama_cpps_mix_and_runs(tmp_path):
    shape = dataclasses.replace(tiny_shape("llama"), n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64,
                                n_layer=8)
    path = write_random_model(tmp_path / "q4km.gguf", shape, dtype="q4_k_m")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["output.weight"] == "Q6_K" and types["blk.3.attn_q.weight"] == "Q4_K"
    # Q6_K in the first and last eighth and every third layer between, as llama.cpp's use_more_bits
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(8)] == \
        ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    (result,) = probe([{"path": str(path), "texts": []}])
    assert_runs_sanely(result)
