"""RidgeFill across llama.cpp's layer split over RPC hosts, on the CPU: two ggml-rpc-server processes on 127.0.0.1
(the CPU backend, one thread each, started and stopped here) take the repeating layers (`--rpc`, `-ngl 99`, split
between them by their memory), the local CPU the embeddings and the output. With one thread everywhere every op
runs the same code on the same numbers wherever it is placed, so the split must give one device's bytes: the
top-5 log-probabilities of four generated tokens, compared as floats."""
from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import time

import pytest

from conftest import SMOLLM2_N_LAYER, require_builds, smollm2_with_random_maps
from ridgefill_gguf import libs
from ridgefill_gguf.serve import Server, free_port

PROMPT = "The river rose through the night, and by morning the lower fields were under water. " * 30
N_PREDICT = 4


@contextlib.contextmanager
def rpc_hosts(build: str, tmp_path, n: int = 2, timeout: float = 30.0):
    """n ggml-rpc-server processes of `build` on 127.0.0.1; yields the --rpc list."""
    binary = libs.find_binary(build, "ggml-rpc-server")
    ports = [free_port() for _ in range(n)]
    logs = [open(tmp_path / f"rpc-{build}-{p}.log", "w") for p in ports]
    procs = [subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(p), "-t", "1"], stdout=log,
                              stderr=subprocess.STDOUT) for p, log in zip(ports, logs)]
    try:
        deadline = time.monotonic() + timeout
        for p, proc in zip(ports, procs):
            while True:
                assert proc.poll() is None, f"rpc-server on port {p} exited ({proc.returncode})"
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", p)) == 0:
                        break
                assert time.monotonic() < deadline, f"rpc-server on port {p} did not listen within {timeout:.0f} s"
                time.sleep(0.1)
        yield ",".join(f"127.0.0.1:{p}" for p in ports)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


def top_probs(response: dict) -> list:
    return [[(t["token"], t["logprob"]) for t in p["top_logprobs"]] for p in response["completion_probabilities"]]


def requests(build: str, model, maps, tmp_path, name: str, rpc: str | None = None, placement: str = "resident",
             arms=("stock", "plain", "probe"), n_layer: int = SMOLLM2_N_LAYER, prompt: str = PROMPT,
             probe_share: float | None = None, tensor_split: str = "1,1", gpus: int = 0) -> dict:
    """Each arm's top log-probabilities and RidgeFill statistics from one server; probe_share: the probe keeps that
    share of the prefix instead of its budget's count. rpc: the layers split over those hosts; gpus: over that many
    CUDA devices (1: all on the first)."""
    # -v: the log names each layer's device
    extra = ("--rpc", rpc, "-ngl", "99", "--tensor-split", tensor_split, "-v") if rpc else ()
    if gpus:
        extra = ("-ngl", "99", "-v") + (("--device", "CUDA0") if gpus == 1 else
                                        ("-sm", "layer", "--device", ",".join(f"CUDA{i}" for i in range(gpus)),
                                         "--tensor-split", tensor_split))
    out = {}
    with Server(model, maps, build=build, tail=256, min_prefix=0, threads=1, n_ctx=2048, placement=placement,
                extra=extra, log_path=tmp_path / f"{name}.log") as srv:
        for arm in arms:
            fields = {"ridgefill": arm != "stock"} if build == "ridgefill" else {}
            if arm == "plain":
                fields["ridgefill_select"] = "none"
            if arm == "probe" and probe_share:
                fields["ridgefill_exact_share"] = probe_share
            r = srv.complete(prompt, n_predict=N_PREDICT, n_probs=5, **fields)
            out[arm] = (top_probs(r), r["timings"].get("ridgefill"))
    log = (tmp_path / f"{name}.log").read_text(errors="replace")
    if rpc:  # every repeating layer went to an RPC host, and both hosts are the server's devices
        used = set(re.findall(r"using device RPC\d+ \((127\.0\.0\.1:\d+)\)", log))
        assert used == set(rpc.split(",")), used
        on = dict(re.findall(r"layer +(\d+) assigned to device (RPC\d+)", log))
        assert {str(il) for il in range(n_layer)} <= set(on) and set(on.values()) == {"RPC0", "RPC1"}, on
    if gpus:  # every repeating layer went to one of the asked GPUs, and each of them holds some
        on = dict(re.findall(r"layer +(\d+) assigned to device (CUDA\d+)", log))
        want = {f"CUDA{i}" for i in range(gpus)}
        assert {str(il) for il in range(n_layer)} <= set(on) and set(on.values()) == want, on
    return out


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return smollm2_with_random_maps(tmp_path_factory.mktemp("devices-rpc"))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen35"])
def test_a_random_models_ridgefill_prefill_on_a_layer_split_over_rpc_hosts_gives_one_devices_bytes(arch, tmp_path):
    require_builds("ridgefill")
    from ridgefill_gguf.maps.synthetic import tiny_model_with_maps

    n_layer = 8
    model, maps = tiny_model_with_maps(tmp_path, arch, n_layer=n_layer, split=2)
    # a hybrid's slot prefills a prompt's last ubatch and more the stock way, to checkpoint its state: 1,500 rows
    # a random model's text has no rows the budget counts: the probe keeps a quarter of the prefix instead
    kw = {"n_layer": n_layer, "prompt": PROMPT * 3, "probe_share": 0.25}
    one = requests("ridgefill", model, maps, tmp_path, "one-device", **kw)
    with rpc_hosts("ridgefill", tmp_path) as rpc:
        split = requests("ridgefill", model, maps, tmp_path, "split", rpc, **kw)
    for arm in ("stock", "plain", "probe"):
        assert split[arm][0] == one[arm][0], arm
    for arm in ("plain", "probe"):
        assert split[arm][1]["filled"] == one[arm][1]["filled"] > 0, arm
        assert split[arm][1]["exact"] == one[arm][1]["exact"], arm
    assert split["probe"][1]["selected"] == one["probe"][1]["selected"] > 100


def test_ridgefill_off_with_maps_attached_on_a_layer_split_over_rpc_hosts_gives_upstreams_bytes(smollm2, tmp_path):
    require_builds()
    model, maps = smollm2
    with rpc_hosts("upstream", tmp_path) as rpc:
        upstream = requests("upstream", model, None, tmp_path, "upstream-split", rpc, arms=("stock",))
    with rpc_hosts("ridgefill", tmp_path) as rpc:
        patched = requests("ridgefill", model, maps, tmp_path, "off-split", rpc, arms=("stock",))
    assert len(upstream["stock"][0]) == N_PREDICT and patched["stock"][1] is None
    assert patched["stock"][0] == upstream["stock"][0]


def test_ridgefill_on_a_layer_split_over_rpc_hosts_gives_one_devices_bytes_and_chooses_the_same_rows(
        smollm2, tmp_path):
    require_builds("ridgefill")
    model, maps = smollm2
    one = requests("ridgefill", model, maps, tmp_path, "one-device")
    with rpc_hosts("ridgefill", tmp_path) as rpc:
        split = requests("ridgefill", model, maps, tmp_path, "split", rpc)
        streamed = requests("ridgefill", model, maps, tmp_path, "split-streamed", rpc, placement="streamed",
                            arms=("probe",))
    for arm in ("stock", "plain", "probe"):
        assert split[arm][0] == one[arm][0], arm
    rows = ("filled", "exact", "tail", "selected")
    for arm in ("plain", "probe"):
        assert {k: split[arm][1][k] for k in rows} == {k: one[arm][1][k] for k in rows}, arm
    assert one["probe"][1]["selected"] > 0 and one["plain"][1]["filled"] > 0
    assert streamed["probe"][0] == one["probe"][0]


def test_a_tensor_split_is_refused_by_name_and_the_server_serves_upstreams_bytes_saying_why(smollm2, tmp_path):
    # -sm tensor makes one meta device that splits every weight over the hosts; RidgeFill's graphs put each late
    # layer on one device, so the maps are refused before any of them goes to a device
    require_builds()
    model, maps = smollm2
    out = {}
    for build, m in (("upstream", None), ("ridgefill", maps)):
        with rpc_hosts(build, tmp_path) as rpc:
            extra = ("--rpc", rpc, "-ngl", "99", "-sm", "tensor", "-v")
            with Server(model, m, build=build, tail=256, min_prefix=0, threads=1, n_ctx=2048, extra=extra,
                        log_path=tmp_path / f"{build}.log") as srv:
                r = srv.complete(PROMPT, n_predict=N_PREDICT, n_probs=5, **({"ridgefill": True} if m else {}))
                out[build] = (top_probs(r), r["timings"].get("ridgefill"), srv.get("/props").get("ridgefill"))
    log = (tmp_path / "ridgefill.log").read_text(errors="replace")
    assert "creating a Meta device for tensor parallelism" in log
    assert "does not run on llama.cpp's tensor split (-sm tensor)" in log
    probs, timings, props = out["ridgefill"]
    assert probs == out["upstream"][0] and len(probs) == N_PREDICT
    assert "refused at start" in timings["not_used"] and props["attached"] is False, (timings, props)


def test_late_layers_on_another_host_read_x_s_masks_inputs_and_the_probes_rows_there_giving_one_devices_bytes(smollm2,
                                                                                                             tmp_path):
    # three quarters of the layers on the first host: the split (15) and late layers 16-23 there, 24-29 on the
    # second, whose graphs read x_S from the copy made there once per prefill (every row: 2,048 x 576 x 4 bytes),
    # make their exact rows' masks in a buffer there (flash attention: F16 over 2,048 cells for a chunk of 2,048) and
    # read the exact rows' inputs there, which layer 23 writes across (two buffers of a chunk's rows)
    require_builds("ridgefill")
    model, maps = smollm2
    one = requests("ridgefill", model, maps, tmp_path, "one-device", arms=("plain", "probe"))
    with rpc_hosts("ridgefill", tmp_path) as rpc:
        split = requests("ridgefill", model, maps, tmp_path, "split-3-1", rpc, arms=("plain", "probe"),
                         tensor_split="3,1")
        # streamed maps: each host stages the maps of its own late layers in slots of its own
        streamed = requests("ridgefill", model, maps, tmp_path, "split-3-1-streamed", rpc, placement="streamed",
                            arms=("plain",), tensor_split="3,1")
    log = (tmp_path / "split-3-1.log").read_text(errors="replace")
    on = dict(re.findall(r"layer +(\d+) assigned to device (RPC\d+)", log))
    assert on["15"] == on["16"] == "RPC0" and on["29"] == "RPC1", on
    second = rpc.split(",")[1]
    copies = re.findall(r"RidgeFill buffers for the context: RPC\d\[" + re.escape(second) + r"\] ([\d.]+) MiB", log)
    assert copies and float(copies[0]) == (2048 * 576 * 4 + 2048 * 2048 * 2 + 2 * 2048 * 576 * 4) / 2**20, copies
    for arm in ("plain", "probe"):
        assert split[arm][0] == one[arm][0], arm
        assert split[arm][1]["filled"] == one[arm][1]["filled"] > 0 and split[arm][1]["exact"] == one[arm][1]["exact"]
        assert one[arm][1]["late_devices"] == 1 and one[arm][1]["bytes_moved"] == 0, one[arm][1]
        assert split[arm][1]["late_devices"] == 2, split[arm][1]
    # what moved, plain: x_S's rows to the second host once, then each row that runs the late layers exactly crosses
    # from layer 23 to 24 once (layer 29 keeps only its K/V: nothing crosses back)
    t = split["plain"][1]
    assert t["bytes_moved"] == (t["rows"] + t["rows"] - t["filled"]) * 576 * 4, t
    # the probe's pass has its rows, masks and scores on each device too: its known and probe rows cross once more,
    # so no row crosses more than twice (a graph reading another device's buffer would copy it whole, every time)
    p = split["probe"][1]
    assert t["bytes_moved"] < p["bytes_moved"] <= 3 * p["rows"] * 576 * 4, p
    assert re.search(r"RidgeFill's late layers \(from the split\): RPC0 15-23, RPC1 24-29", log), log[-2000:]
    assert t["devices"] == "sweep one: RPC0 0-14; late layers: RPC0 15-23, RPC1 24-29", t
    assert one["plain"][1]["devices"] == "sweep one: CPU 0-14; late layers: CPU 15-29", one["plain"][1]
    assert streamed["plain"][0] == one["plain"][0]
    from gguf import GGUFReader
    sizes = {tensor.name: int(tensor.n_bytes) for tensor in GGUFReader(maps).tensors}
    slots = 2 * (sizes["blk.29.rf_map.weight"] + sizes["blk.29.rf_map.bias"]) / 2**20  # two of one layer's map
    log_streamed = (tmp_path / "split-3-1-streamed.log").read_text(errors="replace")
    held = re.findall(r"RidgeFill buffers for the context: RPC\d\[" + re.escape(second) + r"\] ([\d.]+) MiB",
                      log_streamed)
    assert held and abs(float(held[0]) - float(copies[0]) - slots) < 0.01, (held, copies)
