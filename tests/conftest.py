"""Shared fixtures: the project's paths, the two builds, small models."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BUILDS = ("upstream", "ridgefill")


def load_tool(name: str):
    """Import a script from tools/ (they run before the package is installed, so they are not in it)."""
    spec = importlib.util.spec_from_file_location(f"tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def libllama(build: str) -> Path:
    return ROOT / "build" / build / "bin" / "libllama.so"


def require_builds(*builds: str) -> None:
    missing = [b for b in builds or BUILDS if not libllama(b).exists()]
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"build(s) {missing} missing in CI: `make test` builds them first")
        pytest.skip(f"build(s) {missing} not built: run `make build`")


def describe_difference(a: np.ndarray, b: np.ndarray) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.shape} {a.dtype} against {b.shape} {b.dtype}"
    raw = f"u{a.dtype.itemsize}"
    differ = np.flatnonzero(a.reshape(-1).view(raw) != b.reshape(-1).view(raw))
    first = tuple(int(i) for i in np.unravel_index(differ[0], a.shape))
    with np.errstate(invalid="ignore"):
        gaps = np.abs(a.reshape(-1)[differ].astype(np.float64) - b.reshape(-1)[differ])
    finite = gaps[np.isfinite(gaps)]
    largest = f", the largest by {finite.max():.3g}" if finite.size else ""
    other = f", {gaps.size - finite.size} of them NaN or infinite" if finite.size < gaps.size else ""
    return f"{differ.size} of {a.size} values differ, the first at {first}{largest}{other}"


def as_array(x) -> np.ndarray:
    return np.frombuffer(x, np.uint8) if isinstance(x, (bytes, bytearray)) else np.asarray(x)


def failure(what: object, why: str) -> AssertionError:
    return AssertionError(f"{what}: {why}" if what != "" else why)


def assert_same_bytes(a, b, what: object = "") -> None:
    """The two arrays' (or byte strings') shapes, types and bytes are the same, or an AssertionError that says how
    they differ. (pytest's own explanation of two unequal megabyte `bytes` runs difflib over them, which under
    CI=true never ends.)"""
    a, b = as_array(a), as_array(b)
    if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
        raise failure(what, describe_difference(a, b))


def assert_bytes_differ(a, b, what: object = "") -> None:
    a, b = as_array(a), as_array(b)
    if a.tobytes() == b.tobytes():
        raise failure(what, f"the {a.shape} {a.dtype} and {b.shape} {b.dtype} arrays have the same bytes")


def run_py(code: str, build: str | None = None, check: bool = True,
           extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run Python code in a fresh process (a process loads one libllama only)."""
    env = {**os.environ, **(extra_env or {})}
    if build:
        env["RIDGEFILL_GGUF_BUILD"] = build
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    return proc


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """A tiny random-weight GGUF per supported architecture, with a real tokenizer."""
    from ridgefill_gguf.random_gguf import SUPPORTED_ARCHS, tiny_shape, write_random_model

    folder = tmp_path_factory.mktemp("tiny-models")
    return {arch: write_random_model(folder / f"tiny-{arch}.gguf", tiny_shape(arch), seed=1)
            for arch in SUPPORTED_ARCHS}


def is_cuda_build(build: str) -> bool:
    cache = ROOT / "build" / build / "CMakeCache.txt"
    return cache.exists() and "GGML_CUDA:BOOL=ON" in cache.read_text()


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where the patched build is a CUDA build (the device machine), never in CI; those that
    compare against upstream also need a CUDA upstream build (require_cuda_builds)."""
    if is_cuda_build("ridgefill"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA build: run tools/gpu/build-and-test.sh on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def require_cuda_builds(*builds: str) -> None:
    require_builds(*builds)
    missing = [b for b in builds or BUILDS if not is_cuda_build(b)]
    if missing:
        pytest.skip(f"build(s) {missing} are not CUDA builds")


SMOLLM2_SPLIT, SMOLLM2_N_LAYER, SMOLLM2_N_EMBD = 15, 30, 576


def smollm2_with_random_maps(folder: Path) -> tuple[Path, Path]:
    """SmolLM2-135M (make default-model) and random Q8_0 maps for split 15: for tests of the schedule's cost or
    memory, not of its quality. Skips when the model is not there."""
    from ridgefill_gguf.maps.convert import convert
    from ridgefill_gguf.maps.synthetic import write_float_file
    from ridgefill_gguf.models import model_path
    model = model_path("smollm2-135m")
    if not model.exists():
        pytest.skip(f"{model} is not there (make default-model)")
    src = write_float_file(folder / "maps.safetensors", SMOLLM2_SPLIT,
                           list(range(SMOLLM2_SPLIT + 1, SMOLLM2_N_LAYER)), SMOLLM2_N_EMBD, dtype="f16", seed=1)
    return model, Path(convert(src, folder / "maps.gguf", model=model).out)


def tiny_qwen3_with_random_maps(folder: Path):
    """A 4-layer random qwen3 with a real tokenizer and random maps at split 1, for the eval instruments."""
    import dataclasses

    from ridgefill_gguf.maps.synthetic import write_random_maps
    from ridgefill_gguf.random_gguf import tiny_shape, write_random_model

    model = write_random_model(folder / "m.gguf", dataclasses.replace(tiny_shape("qwen3"), n_layer=4), seed=9)
    return model, write_random_maps(model, 1, folder / "maps.gguf")
