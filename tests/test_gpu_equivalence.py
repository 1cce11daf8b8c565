"""On CUDA, with every layer on the GPU, the patched build still matches upstream byte for byte."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import require_cuda_builds
from ridgefill_gguf import equivalence
from ridgefill_gguf.logits import Case
from ridgefill_gguf.maps.synthetic import write_random_maps
from ridgefill_gguf.random_gguf import tiny_shape, write_random_model

pytestmark = pytest.mark.gpu

# flash attention on and off, one ubatch and several, and a batch large enough for the GPU's big-batch kernels
GPU_CASES = [Case(512, 512, True), Case(512, 512, False), Case(512, 128, True), Case(256, 33, True)]
LONG_PROMPT = "In the beginning the Universe was created. This has made a lot of people very angry. " * 40


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen35", "qwen3next", "gemma3"])
@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_cuda_builds_give_byte_identical_logits_with_all_layers_on_the_gpu(arch, dtype, tmp_path):
    require_cuda_builds()
    shape = tiny_shape(arch)
    model = write_random_model(tmp_path / f"{arch}-{dtype}.gguf", shape, dtype=dtype, seed=3)
    report = equivalence.check(model, prompts=equivalence.DEFAULT_PROMPTS + [LONG_PROMPT], cases=GPU_CASES,
                               n_ctx=4096, decode_steps=4, n_gpu_layers=-1)
    bad = [r["key"] for r in report["arrays"] if not r["identical"]]
    assert report["n_logits"] > 0 and not bad, f"{arch}/{dtype}: arrays differ: {bad}"


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen35", "qwen3next", "gemma3"])
def test_cuda_builds_stay_byte_identical_with_maps_attached_and_ridgefill_off(arch, tmp_path):
    require_cuda_builds()
    shape = dataclasses.replace(tiny_shape(arch), n_layer=4)
    model = write_random_model(tmp_path / f"{arch}-q8_0.gguf", shape, dtype="q8_0", seed=3)
    maps = write_random_maps(model, 2, tmp_path / "maps.gguf")
    report = equivalence.check(model, prompts=equivalence.DEFAULT_PROMPTS + [LONG_PROMPT], cases=GPU_CASES,
                               n_ctx=4096, decode_steps=4, n_gpu_layers=-1, maps=maps)
    bad = [r["key"] for r in report["arrays"] if not r["identical"]]
    assert report["n_logits"] > 0 and not bad, f"{arch} with maps attached: arrays differ: {bad}"
