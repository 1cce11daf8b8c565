"""llama-server counts RidgeFill's memory where llama.cpp counts its own: --fit (on by default) measures the context
with the maps attached, so its projection grows by the maps and RidgeFill's buffers, and the memory breakdown the
server prints on exit shows the maps as model memory and the buffers as context memory (CPU, SmolLM2)."""
from __future__ import annotations

import re

import pytest

from conftest import SMOLLM2_N_EMBD as N_EMBD, require_builds, smollm2_with_random_maps
from ridgefill_gguf.bench_memory import compute_growth, parse_breakdown
from ridgefill_gguf.serve import Server

N_CTX, N_UBATCH, PROBE_ROWS, TAIL = 8192, 512, 256, 1024
MiB = 1 << 20


@pytest.fixture(scope="module")
def smollm2_with_maps(tmp_path_factory):
    return smollm2_with_random_maps(tmp_path_factory.mktemp("server-memory"))


def expected_buffers(d: int) -> int:
    """Flash attention off: x_S of every row, a ubatch's F32 mask over every cell, the inputs of the tail and
    position 0 twice, and the server's default selector, the probe: its rows twice, their F32 mask and the cells'
    scores."""
    return (4 * d * N_CTX + 4 * N_CTX * N_UBATCH + 2 * 4 * d * (TAIL + 1)
            + 2 * 4 * d * PROBE_ROWS + 4 * N_CTX * PROBE_ROWS + 4 * N_CTX)


def run_server(model, maps, log_path, more: tuple = ()) -> tuple[str, list[dict]]:
    """A server started and stopped; with maps it first serves one plain RidgeFill request of 4,000 tokens, whose
    exact rows (the tail and position 0) fit the buffers attach made, then one whose probe keeps half the prefix
    exact."""
    extra = ("-fa", "off", "-b", str(N_UBATCH), "-ub", str(N_UBATCH), "-v") + more
    timings = []
    with Server(model, maps, n_ctx=N_CTX, threads=2, extra=extra, log_path=log_path,
                tail=TAIL if maps else None) as srv:
        if maps:
            prompt = [1000 + (i * 7919) % 20000 for i in range(4000)]
            for fields in ({"ridgefill_select": "none"},
                           {"ridgefill_select": "probe", "ridgefill_exact_share": 0.5}):
                r = srv.complete(prompt, n_predict=1, ridgefill=True, **fields)
                assert r["timings"]["ridgefill"]["filled"] > 0, r["timings"]
                timings.append(r["timings"]["ridgefill"])
    return log_path.read_text(errors="replace"), timings


def fit_projection_mib(log: str) -> int:
    m = re.search(r"projected to use (\d+) MiB of host memory", log)
    assert m, log[-3000:]
    return int(m.group(1))


def host_breakdown_mib(log: str) -> tuple[int, int]:
    """(model, context) MiB of the Host row of the breakdown printed on exit."""
    host = parse_breakdown(log).get("Host")
    assert host, log[-3000:]
    return host["model"], host["context"]


@pytest.fixture(scope="module")
def logs(smollm2_with_maps, tmp_path_factory):
    require_builds("ridgefill")
    model, maps = smollm2_with_maps
    d = tmp_path_factory.mktemp("server-memory-logs")
    stock, _ = run_server(model, None, d / "stock.log")
    rf, timings = run_server(model, maps, d / "ridgefill.log")
    return stock, rf, maps, model, timings


def test_fit_projects_the_maps_and_ridgefill_buffers_beside_the_model(logs):
    stock, rf, maps, model, _ = logs
    grown = fit_projection_mib(rf) - fit_projection_mib(stock)
    expected = (maps.stat().st_size + expected_buffers(N_EMBD)) / MiB
    assert abs(grown - expected) <= 2, (grown, expected)


def test_the_exit_breakdown_shows_the_maps_as_model_and_the_buffers_as_context_memory(logs):
    stock, rf, maps, model, _ = logs
    (m0, c0), (m1, c1) = host_breakdown_mib(stock), host_breakdown_mib(rf)
    assert abs((m1 - m0) - maps.stat().st_size / MiB) <= 1, (m0, m1)
    assert abs((c1 - c0) - expected_buffers(N_EMBD) / MiB) <= 1, (c0, c1)
    assert "RidgeFill buffers for the context" in rf


def test_a_ridgefill_prefill_within_the_tail_grows_nothing_beyond_what_attach_reserved_and_fit_projected(logs):
    _, rf, _, _, _ = logs
    assert parse_breakdown(rf)["Host"]["self"] == fit_projection_mib(rf)
    reserved = float(re.findall(r"RidgeFill's graphs reserved: CPU compute buffer ([\d.]+) MiB", rf)[-1])
    # llama.cpp says how big the compute buffer was when the context was freed, where it differs from its own
    # reservation at context creation
    grown = compute_growth(rf).get("CPU")
    held = grown["held_mib"] if grown else float(re.findall(r"CPU compute buffer size = +([\d.]+) MiB", rf)[-1])
    assert abs(held - reserved) < 0.01, (held, reserved)


def test_a_prefill_with_more_exact_rows_than_attach_made_room_for_runs_in_the_same_buffers(logs):
    # the second request's exact rows are the probe's half of the prefix and the tail, more than twice the rows
    # of the tail and position 0 that attach made room for; its chunks take those rows in turn, so the context
    # memory the breakdown shows on exit is still attach's
    stock, rf, _, _, timings = logs
    assert timings[1]["exact"] + timings[1]["tail"] > 2 * (TAIL + 1), timings
    (_, c0), (_, c1) = host_breakdown_mib(stock), host_breakdown_mib(rf)
    assert abs((c1 - c0) - expected_buffers(N_EMBD) / MiB) <= 1, (c0, c1, timings)


@pytest.mark.parametrize("state_update", ["fused", "chunked"])
def test_a_hybrids_ridgefill_prefill_needs_no_compute_buffer_beyond_what_attach_reserved(state_update, tmp_path):
    # a wide model, small ubatches and flash attention off: the carry's chunk of every row (up to 2,048 here) outgrows
    # the exact rows' graphs of a ubatch, so a compute buffer sized without the recurrent graphs grows at once;
    # upstream's chunked graph needs more than the fused op (82.9 against 66.1 MiB here)
    require_builds("ridgefill")
    from ridgefill_gguf.maps.synthetic import tiny_model_with_maps

    model, maps = tiny_model_with_maps(tmp_path, "qwen35", n_layer=8, split=2, n_embd=512, ssm_d_state=64,
                                       ssm_dt_rank=16, ssm_n_group=4)
    extra = ("-fa", "off", "-b", "64", "-ub", "64", "-v", "--override-kv", "qwen35.context_length=int:8192",
             "--ridgefill-state-update", state_update)
    with Server(model, maps, n_ctx=2048, threads=2, extra=extra, log_path=tmp_path / "hybrid.log", tail=256,
                min_prefix=0) as srv:
        for fields in ({"ridgefill_select": "none"}, {"ridgefill_select": "probe"},
                       {"ridgefill_select": "probe", "ridgefill_exact_share": 0.9}):
            r = srv.complete([1000 + (i * 7919) % 20000 for i in range(1900)], n_predict=1, ridgefill=True,
                             cache_prompt=False, **fields)
            assert r["timings"]["ridgefill"]["filled"] > 0, r["timings"]
    log = (tmp_path / "hybrid.log").read_text(errors="replace")
    # a hybrid's carry groups (2,048 rows here: the context) pass the late layers together, and attach made room for
    # one group's exact rows, so even 90% of the prefix exact grows nothing
    assert "grows" not in log[log.index("RidgeFill prefill of"):], log[-3000:]
    reserved = float(re.findall(r"RidgeFill's graphs reserved: CPU compute buffer ([\d.]+) MiB", log)[-1])
    grown = compute_growth(log).get("CPU")
    held = grown["held_mib"] if grown else float(re.findall(r"CPU compute buffer size = +([\d.]+) MiB", log)[-1])
    assert abs(held - reserved) < 0.01, (held, reserved, grown)


def test_with_the_rescale_flag_fit_projects_room_for_every_rows_input_and_a_rescaled_prefill_grows_nothing(
        smollm2_with_maps, logs, tmp_path):
    # the rescales run the late layers layer by layer, where every exact row's input waits: the flag sizes those
    # inputs for the context's every row (and the norms of the 512 measuring rows) before --fit measures
    stock, _, _, _, _ = logs
    model, maps = smollm2_with_maps
    rf, timings = run_server(model, maps, tmp_path / "rescale.log", more=("--ridgefill-rescale", "values"))
    n_head_kv = 3  # SmolLM2-135M
    expected = (maps.stat().st_size + expected_buffers(N_EMBD) + 2 * 4 * N_EMBD * (N_CTX - TAIL - 1)
                + 4 * 4 * n_head_kv * 512) / MiB
    assert abs((fit_projection_mib(rf) - fit_projection_mib(stock)) - expected) <= 2, expected
    assert timings[1]["exact"] + timings[1]["tail"] > 2 * (TAIL + 1), timings
    assert [t["rescale"] for t in timings] == ["values", "values"], timings
    assert parse_breakdown(rf)["Host"]["self"] == fit_projection_mib(rf)
    # the flag's room is made once the server's parameters are set at start, before any request
    assert "grows" not in rf[rf.index("RidgeFill prefill of"):]


def test_sweep_ones_attention_score_for_the_probes_budget_fits_in_what_attach_reserved(tmp_path):
    # with the budget the probe also counts the attention the prompt's last rows pay the prefix in the layers below
    # the split; sweep one sums it in the ubatch that holds them. Many query heads per KV head, a context of 8,192
    # cells and flash attention on (whose stock graph holds no [cells x rows x heads] matrix) make that sum the
    # largest graph, as for the 27B hybrid shape at 128K on CUDA
    require_builds("ridgefill")
    from ridgefill_gguf.maps.synthetic import tiny_model_with_maps

    model, maps = tiny_model_with_maps(tmp_path, "qwen35", n_layer=8, split=4, n_embd=256, n_head=16, n_head_kv=2,
                                       head_dim=16)
    extra = ("-fa", "on", "-b", "512", "-ub", "512", "-v", "--override-kv", "qwen35.context_length=int:8192")
    with Server(model, maps, n_ctx=8192, threads=2, extra=extra, log_path=tmp_path / "score.log", tail=256,
                min_prefix=0) as srv:
        for select in ("none", "probe"):
            r = srv.complete([1000 + (i * 7919) % 20000 for i in range(8000)], n_predict=1, ridgefill=True,
                             cache_prompt=False, ridgefill_select=select)
            assert r["timings"]["ridgefill"]["filled"] > 0, r["timings"]
    assert r["timings"]["ridgefill"]["budget"] > 0, r["timings"]  # the budget's rows came from that score
    log = (tmp_path / "score.log").read_text(errors="replace")
    reserved = float(re.findall(r"RidgeFill's graphs reserved: CPU compute buffer ([\d.]+) MiB", log)[-1])
    grown = compute_growth(log).get("CPU")
    held = grown["held_mib"] if grown else float(re.findall(r"CPU compute buffer size = +([\d.]+) MiB", log)[-1])
    assert abs(held - reserved) < 0.01, (held, reserved, grown)
