"""On CUDA, capture that keeps layer inputs on the GPU gives the rows and sums of the host path (issue 4's
fast path: no crossing to the host and back)."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import require_cuda_builds, run_py
from ridgefill_gguf.random_gguf import tiny_shape, write_random_model

pytestmark = pytest.mark.gpu

TEXT = "Capture reads the residual stream before each layer's first norm, for every prompt row. " * 30


def test_capture_kept_on_the_gpu_gives_the_rows_of_the_host_capture(tmp_path):
    require_cuda_builds("ridgefill")
    model = write_random_model(tmp_path / "qwen3.gguf", dataclasses.replace(tiny_shape("qwen3"), n_layer=4),
                               dtype="q8_0", seed=5)
    code = f"""
import torch
from ridgefill_gguf.fit.capture import Capturer
cap = Capturer({str(model)!r}, 1, n_ctx=1024, n_batch=128, n_gpu_layers=-1)
tokens = cap.tokenize({TEXT!r}, 600)
host = cap.run(tokens)
gpu = cap.run(tokens, device="cuda")
cap.close()
assert all(gpu[l].is_cuda for l in gpu)
print(len(tokens), max(float((torch.from_numpy(host[l]) - gpu[l].cpu()).abs().max()) for l in host))
"""
    n, diff = run_py(code, "ridgefill").stdout.split()[-2:]
    assert int(n) > 300 and float(diff) == 0.0
