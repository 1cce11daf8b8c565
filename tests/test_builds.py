"""Both builds exist, load models through llama-cpp-python, and agree byte for byte with RidgeFill off."""
from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from conftest import BUILDS, ROOT, require_builds, run_py
from ridgefill_gguf import equivalence, models
from ridgefill_gguf.engine import bindings
from ridgefill_gguf.logits import Case

TARGETS = ("libllama.so", "libggml.so", "libggml-base.so", "llama-server", "llama-cli", "llama-perplexity")


@pytest.mark.parametrize("build", BUILDS)
def test_each_build_has_the_libraries_and_tools(build):
    require_builds(build)
    for name in TARGETS:
        assert (ROOT / "build" / build / "bin" / name).exists(), f"{build} lacks {name}"


@pytest.mark.parametrize("build", BUILDS)
def test_each_build_runs_its_server_and_cli(build):
    require_builds(build)
    for tool in ("llama-server", "llama-cli"):
        proc = subprocess.run([str(ROOT / "build" / build / "bin" / tool), "--version"], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
        assert proc.returncode == 0 and "version" in proc.stdout, proc.stdout


def test_the_patched_library_has_the_ridgefill_api_and_upstream_has_none():
    require_builds()
    probe = ("from ridgefill_gguf.engine import bindings; import json; "
             "ok = bindings.available(); "
             "print(json.dumps([ok, bindings.load().build_info if ok else None]))")
    patched = json.loads(run_py(probe, "ridgefill").stdout.strip().splitlines()[-1])
    upstream = json.loads(run_py(probe, "upstream").stdout.strip().splitlines()[-1])
    assert patched[0] is True and patched[1].startswith(f"ridgefill api {bindings.API_VERSION} ")
    assert upstream == [False, None]


def test_a_process_refuses_to_switch_builds_after_loading_one():
    require_builds()
    proc = run_py("from ridgefill_gguf import libs\nlibs.use_build('upstream')\nlibs.use_build('ridgefill')",
                  check=False)
    assert proc.returncode != 0 and "needs a new process" in proc.stdout


@pytest.mark.parametrize("build", BUILDS)
def test_each_build_gives_finite_logits_for_a_tiny_model(build, tiny_models, tmp_path):
    require_builds(build)
    spec = equivalence.DumpSpec(model=str(tiny_models["qwen3"]), prompts=["Hello world, this is a test."],
                                cases=[Case()], decode_steps=2)
    logits = equivalence.run_dump(build, spec, tmp_path)
    prompt = logits["b512-ub512-faoff/0/prompt"]
    assert prompt.ndim == 2 and prompt.shape[0] == len(logits["b512-ub512-faoff/0/tokens"])
    assert np.isfinite(prompt).all() and prompt.std() > 0
    assert not np.array_equal(prompt[0], prompt[-1])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen35", "qwen3next", "gemma3"])
def test_the_patched_build_gives_logits_byte_identical_to_upstream(arch, tiny_models):
    require_builds()
    report = equivalence.check(tiny_models[arch], decode_steps=3)
    bad = [r["key"] for r in report["arrays"] if not r["identical"]]
    assert report["n_logits"] > 0 and not bad, f"{arch}: arrays differ: {bad}"


def test_the_patched_build_gives_logits_byte_identical_to_upstream_on_a_real_model():
    require_builds()
    path = models.model_path(models.DEFAULT_MODEL)
    if not path.exists():
        pytest.skip(f"{path.name} not fetched: `make models`")
    report = equivalence.check(path, decode_steps=4)
    bad = [r["key"] for r in report["arrays"] if not r["identical"]]
    assert report["n_logits"] > 100_000 and not bad, f"arrays differ: {bad}"


def test_the_comparison_sees_a_single_flipped_bit():
    a = {"x/0/prompt": np.arange(12, dtype=np.float32).reshape(3, 4)}
    b = {"x/0/prompt": a["x/0/prompt"].copy()}
    b["x/0/prompt"].view(np.uint32)[1, 2] ^= 1
    (row,) = equivalence.compare(a, b)
    assert not row.identical and row.n_diff == 1 and 0 < row.max_abs_diff < 1e-5
    (same,) = equivalence.compare(a, {"x/0/prompt": a["x/0/prompt"].copy()})
    assert same.identical and same.n_diff == 0
