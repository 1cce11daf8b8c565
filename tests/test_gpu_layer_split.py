"""RidgeFill on llama.cpp's layer split over two CUDA GPUs (`-sm layer`), the GPU side of tests/test_devices_rpc.py:
on a machine of several GPUs (tools/gpu/multi-gpu-runs.sh), tiny random models whose repeating layers the server
splits over CUDA0 and CUDA1. Skipped where fewer than two GPUs are visible."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from conftest import require_cuda_builds
from test_devices_rpc import PROMPT, requests

pytestmark = pytest.mark.gpu

N_LAYER, SPLIT = 8, 2
# a random model's text has no rows the budget counts: the probe keeps a quarter of the prefix instead
KW = {"n_layer": N_LAYER, "prompt": PROMPT * 3, "probe_share": 0.25}


def require_gpus(n: int) -> None:
    require_cuda_builds()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:  # nvidia-smi lists every GPU whatever CUDA may use
        found = len(visible.split(","))
    else:
        found = subprocess.run(["nvidia-smi", "-L"], text=True, capture_output=True).stdout.count("GPU ") \
            if shutil.which("nvidia-smi") else 0
    if found < n:
        pytest.skip(f"needs {n} CUDA GPUs; {found} visible")


def tiny(tmp_path, arch: str):
    from ridgefill_gguf.maps.synthetic import tiny_model_with_maps

    return tiny_model_with_maps(tmp_path, arch, n_layer=N_LAYER, split=SPLIT)


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_ridgefill_off_with_maps_attached_on_a_cuda_layer_split_gives_upstreams_bytes_on_the_same_split(arch,
                                                                                                        tmp_path):
    require_gpus(2)
    model, maps = tiny(tmp_path, arch)
    upstream = requests("upstream", model, None, tmp_path, "upstream-split", arms=("stock",), gpus=2, **KW)
    patched = requests("ridgefill", model, maps, tmp_path, "off-split", arms=("stock",), gpus=2, **KW)
    assert upstream["stock"][0] and patched["stock"][1] is None
    assert patched["stock"][0] == upstream["stock"][0]


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_ridgefill_on_a_cuda_layer_split_chooses_one_gpus_rows_and_gives_its_bytes(arch, tmp_path):
    require_gpus(2)
    model, maps = tiny(tmp_path, arch)
    one = requests("ridgefill", model, maps, tmp_path, "one-gpu", gpus=1, **KW)
    split = requests("ridgefill", model, maps, tmp_path, "split", gpus=2, **KW)
    streamed = requests("ridgefill", model, maps, tmp_path, "split-streamed", placement="streamed",
                        arms=("plain",), gpus=2, **KW)
    rows = ("filled", "exact", "tail", "selected")
    for arm in ("plain", "probe"):
        assert {k: split[arm][1][k] for k in rows} == {k: one[arm][1][k] for k in rows}, arm
        assert split[arm][1]["late_devices"] == 2 and one[arm][1]["late_devices"] == 1, arm
    assert one["probe"][1]["selected"] > 100 and one["plain"][1]["filled"] > 0
    # every op runs the same kernel on the same numbers on either GPU of one kind
    for arm in ("stock", "plain", "probe"):
        assert split[arm][0] == one[arm][0], arm
    assert streamed["plain"][0] == one["plain"][0]


def test_late_layers_on_the_second_gpu_read_x_s_there_and_each_exact_row_crosses_once(tmp_path):
    # three quarters of the layers on CUDA0: the split and the first late layers there, the last ones on CUDA1
    require_gpus(2)
    model, maps = tiny(tmp_path, "llama")
    split = requests("ridgefill", model, maps, tmp_path, "split-3-1", arms=("plain",), gpus=2, tensor_split="3,1",
                     **KW)
    t = split["plain"][1]
    log = (tmp_path / "split-3-1.log").read_text(errors="replace")
    on = dict(re.findall(r"layer +(\d+) assigned to device (CUDA\d+)", log))
    first_on_second = min(int(il) for il, dev in on.items() if dev == "CUDA1")
    assert SPLIT < first_on_second < N_LAYER, on
    assert t["devices"] == (f"sweep one: CUDA0 0-{SPLIT - 1}; late layers: CUDA0 {SPLIT}-{first_on_second - 1}, "
                            f"CUDA1 {first_on_second}-{N_LAYER - 1}"), t
    from ridgefill_gguf.random_gguf import ModelShape

    n_embd = ModelShape.from_gguf(model).n_embd
    # x_S's rows to CUDA1 once, then each row run exactly crosses from the last layer on CUDA0 to the first on CUDA1
    assert t["bytes_moved"] == (t["rows"] + t["rows"] - t["filled"]) * n_embd * 4, t
