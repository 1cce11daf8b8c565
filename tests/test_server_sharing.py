"""llama-server keeps serving the other users while a RidgeFill prefill runs: the prefill runs in steps between the
other slots' batches, so a user streaming tokens in another slot waits no longer than under a stock prefill of the
same prompt (SmolLM2, 2 slots, CPU, bounded), and a request cancelled in the middle of its RidgeFill prefill
leaves the server serving."""
from __future__ import annotations

import http.client
import json
import time

import pytest

from conftest import require_builds, smollm2_with_random_maps
from ridgefill_gguf.serve import Server
from ridgefill_gguf.serving import one_cell


@pytest.fixture(scope="module")
def smollm2_with_maps(tmp_path_factory):
    d = tmp_path_factory.mktemp("sharing")
    return (*smollm2_with_random_maps(d), d)  # random maps: the schedule's cost, not its quality, is under test


def two_slot_server(model, maps, log_path) -> Server:
    """Plain RidgeFill (no selector), tail 256, batches of 512, two slots of 2,560 cells."""
    extra = ("-b", "512", "-ub", "512", "--ridgefill-select", "none")
    return Server(model, maps, tail=256, min_prefix=0, threads=2, slots=2, n_ctx=2 * 2560, extra=extra,
                  log_path=log_path)


def prompt_tokens(n: int) -> list[int]:
    return [1] + [1000 + (i * 7919) % 40000 for i in range(n - 1)]


def test_another_user_streaming_waits_no_longer_during_a_ridgefill_prefill_than_during_a_stock_one(
        smollm2_with_maps):
    require_builds("ridgefill")
    model, maps, d = smollm2_with_maps
    with two_slot_server(model, maps, d / "sharing.log") as srv:
        prompt = prompt_tokens(2300)
        cells = [one_cell(srv, prompt, 2, rf, others_prompt=prompt_tokens(16)) for rf in (False, True)]
    stock, rf = cells
    assert not stock["errors"] and not rf["errors"], cells
    assert stock["rf"] is None and rf["rf"]["filled"] > 0 and rf["rf"]["slices"] > 1, rf["rf"]
    # the prefill's own time counts the device work it left for the others' batches to wait on (none on the CPU)
    assert 0 <= rf["rf"]["sync_ms"] <= rf["rf"]["total_ms"] <= rf["rf"]["wall_ms"], rf["rf"]
    # the longest slice is what the other user waited at most for the prefill
    assert 0 < rf["rf"]["slice_max_ms"] <= rf["rf"]["total_ms"], rf["rf"]
    assert rf["rf"]["slice_max_stage"] in ("begin", "sweep one", "probe", "fill", "late layers", "done"), rf["rf"]
    assert rf["others_tokens_during"] >= 2, rf  # the other user got tokens while the prefill ran
    assert rf["stall_max_s"] <= stock["stall_max_s"], (rf["stall_max_s"], stock["stall_max_s"])
    # the log follows the prefill as it follows a stock prompt: a line as each stage begins, each two seconds within
    log = (d / "sharing.log").read_text()
    marks = [log.find(f"RidgeFill prefill: {stage}, ") for stage in ("sweep one", "late layers")]
    assert 0 <= marks[0] < marks[1] < log.find("RidgeFill prefill: 2299 rows"), log[-3000:]


def send_stream(srv: Server, body: dict) -> http.client.HTTPConnection:
    """Sends a streamed /completion and returns without reading (its headers may wait for the first token)."""
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=120)
    conn.request("POST", "/completion", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    return conn


def wait_for(check, what: str, timeout: float = 60) -> None:
    # once a client has gone, read the server's log, not its endpoints: llama-server notices a closed connection
    # only after a second without a result for any task
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def slot_state(srv: Server, slot: int) -> dict:
    return next(s for s in srv.get("/slots") if s["id"] == slot)


def slot_busy(srv: Server, slot: int) -> bool:
    return slot_state(srv, slot)["is_processing"]


def in_flight(srv: Server, slot: int) -> bool:
    rf = slot_state(srv, slot).get("ridgefill")
    return bool(rf and rf["in_flight"])


def test_a_request_cancelled_in_the_middle_of_its_ridgefill_prefill_leaves_the_server_serving(smollm2_with_maps):
    require_builds("ridgefill")
    model, maps, d = smollm2_with_maps
    with two_slot_server(model, maps, d / "cancel.log") as srv:
        prompt = prompt_tokens(2300)
        conn = send_stream(srv, {"prompt": prompt, "n_predict": 4, "cache_prompt": False})
        conn.getresponse()  # the headers come before the prefill
        wait_for(lambda: "RidgeFill prefill of 2299 rows begun" in srv.log_tail(None), "the prefill")
        conn.close()  # the client goes away in the middle of the prefill
        wait_for(lambda: "RidgeFill prefill cancelled" in srv.log_tail(None), "the cancel")
        after = srv.complete(prompt, n_predict=2)
        slots = srv.get("/slots")
    log = (d / "cancel.log").read_text()
    assert "RidgeFill prefill cancelled" in log and "RidgeFill prefill: 2299 rows" in log, log[-3000:]
    assert log.index("RidgeFill prefill cancelled") < log.index("RidgeFill prefill: 2299 rows")  # the second one ran it all
    assert after["timings"]["ridgefill"]["filled"] > 0 and after["tokens_predicted"] == 2
    assert all(not s["is_processing"] for s in slots)
    # /slots: each slot's RidgeFill request (null where the server's settings apply) and whether it is in flight
    served = [s["ridgefill"] for s in slots if "id_task" in s]
    assert served and all(r["requested"] is True and r["select"] is None and r["in_flight"] is False for r in served)


def test_the_serving_command_writes_json_markdown_and_a_plot_of_the_stalls(smollm2_with_maps, tmp_path):
    require_builds("ridgefill")
    from click.testing import CliRunner

    from ridgefill_gguf.cli import main

    model, maps, _ = smollm2_with_maps
    res = CliRunner().invoke(main, ["serving", str(model), "--maps", str(maps), "--lengths", "1024", "--users", "2",
                                    "--kv", "unified", "--tail", "256", "--select", "none", "-t", "2",
                                    "--out", str(tmp_path), "--label", "smollm2"])
    assert res.exit_code == 0, res.output
    import json

    out = json.loads(next(tmp_path.glob("*-smollm2.json")).read_text())
    arms = {r["arm"]: r for r in out["summary"]}
    assert set(arms) == {"stock", "ridgefill"} and all(r["errors"] == 0 for r in arms.values())
    assert [c["rf"]["filled"] > 0 for c in out["cells"] if c["ridgefill"]] == [True]
    assert next(tmp_path.glob("*-smollm2.png")).stat().st_size > 0 and "| 2 | unified | ridgefill |" in res.output
    # the table says which step held the others longest (the stock row has none)
    assert arms["ridgefill"]["longest_slice"].endswith(")") and arms["stock"]["longest_slice"] == "", arms


def test_another_user_streaming_waits_no_longer_during_a_hybrids_ridgefill_prefill_than_during_a_stock_one(tmp_path):
    # a hybrid's late layers yield too (its recurrent cell is looked up at every graph), so the other user's tokens
    # keep coming through them; a late step is at most a chunk or a fill through one layer, shorter than a stock
    # batch of 512 rows through all 8 layers
    require_builds("ridgefill")
    from ridgefill_gguf.maps.synthetic import tiny_model_with_maps

    model, maps = tiny_model_with_maps(tmp_path, "qwen35", n_layer=8, split=2, n_embd=1024, n_ff=3072)
    # yield at every step: the test is that the late layers yield at all, not the default's trade
    extra = ("-b", "512", "-ub", "512", "--ridgefill-select", "none", "--ridgefill-yield-ms", "0",
             "--override-kv", "qwen35.context_length=int:8192")
    with Server(model, maps, tail=256, min_prefix=0, threads=2, slots=2, n_ctx=2 * 4096, extra=extra,
                log_path=tmp_path / "hybrid-sharing.log") as srv:
        prompt = prompt_tokens(2000)
        cells = [one_cell(srv, prompt, 2, rf, others_prompt=prompt_tokens(16)) for rf in (False, True)]
    stock, rf = cells
    print({k: (stock[k], rf[k]) for k in ("stall_max_s", "others_tokens_during", "ttft_s") if k in rf}, rf["rf"])
    assert not stock["errors"] and not rf["errors"], cells
    assert rf["rf"]["filled"] > 0 and rf["rf"]["slices"] > 1, rf["rf"]
    # sweep one yields 3 times (batches of 512); the late layers, 6 of them with a fill and a carry each, the rest
    assert rf["others_tokens_during"] >= 10, rf
    # the prompt's last rows run as one stock batch after the prefill, so the worst stall is that batch in both arms
    assert rf["stall_max_s"] <= 1.2 * stock["stall_max_s"], (rf["stall_max_s"], stock["stall_max_s"])


FOLLOW_UP = [2000 + 37 * i for i in range(48)]
EXACT_ONLY = {"n_predict": 4, "n_probs": 5, "cache_prompt": True, "ridgefill_reuse": "exact-only"}


def test_an_exact_only_follow_up_released_while_its_resumed_prefill_runs_or_waits_leaves_nothing_held_behind(
        smollm2_with_maps):
    # running: the prefill is cancelled with its rows, the kept ones too. Waiting for another slot's prefill: that one
    # began by letting the held state go, so the follow-up kept nothing and waits clamped at its first approximated
    # row. Either way the next follow-up prefills from there and answers as one that never held rows, and a stock
    # request reuses none of them
    from test_server import STOCK_NOISE, top_logprob_gap

    require_builds("ridgefill")
    model, maps, d = smollm2_with_maps
    doc, other = prompt_tokens(2300), [1] + [3000 + (i * 7907) % 40000 for i in range(2299)]
    # the default selector (its probe makes the resumed prefill longer); no RAM prompt cache, which would give slot 0
    # slot 1's copy of the document instead of a prefill
    extra = ("-b", "512", "-ub", "512", "--cache-ram", "0")
    with Server(model, maps, tail=256, min_prefix=0, threads=2, slots=2, n_ctx=2 * 2560, extra=extra,
                log_path=d / "release.log") as srv:
        srv.complete(doc, n_predict=1, cache_prompt=True, id_slot=1)
        srv.complete(other, n_predict=1, cache_prompt=True, id_slot=0)  # the engine holds slot 0's rows now
        fresh = srv.complete(doc + FOLLOW_UP, id_slot=1, **EXACT_ONLY)

        srv.complete(doc, n_predict=1, cache_prompt=True, id_slot=0)
        conn = send_stream(srv, {"prompt": doc + FOLLOW_UP, "id_slot": 0, **EXACT_ONLY})
        wait_for(lambda: "resumed from the held split state" in srv.log_tail(None), "the resumed prefill")
        conn.close()  # the client goes away while the resumed prefill runs
        wait_for(lambda: "RidgeFill prefill cancelled" in srv.log_tail(None), "the cancel")
        after_run = srv.complete(doc + FOLLOW_UP, id_slot=0, **EXACT_ONLY)

        busy = send_stream(srv, {"prompt": other, "id_slot": 1, "n_predict": 1, "cache_prompt": False})
        wait_for(lambda: in_flight(srv, 1), "slot 1's prefill")
        conn = send_stream(srv, {"prompt": doc + FOLLOW_UP, "id_slot": 0, **EXACT_ONLY})
        wait_for(lambda: slot_busy(srv, 0), "slot 0 to take the follow-up")
        waiting, text = in_flight(srv, 1), srv.log_tail(None)
        released, done = text.count("release: id  0 |"), text.count("RidgeFill prefill: 2299 rows")
        conn.close()  # the client goes away while the follow-up waits for slot 1's prefill
        wait_for(lambda: srv.log_tail(None).count("release: id  0 |") > released, "slot 0's release")
        text = srv.log_tail(None)
        waiting &= text[:text.rfind("release: id  0 |")].count("RidgeFill prefill: 2299 rows") == done
        busy.getresponse().read()
        after_wait = srv.complete(doc + FOLLOW_UP, id_slot=0, **EXACT_ONLY)
        stock = srv.complete(doc + FOLLOW_UP, id_slot=0, n_predict=4, n_probs=5, ridgefill=False, cache_prompt=True)
        text = srv.log_tail(None)
    assert text.count("RidgeFill prefill cancelled") == 1 and waiting, text[-3000:]
    rf_fresh = fresh["timings"]["ridgefill"]
    start = fresh["timings"]["cache_n"]
    assert rf_fresh["resumed"] == 0 and rf_fresh["rows"] > 2000
    for after in (after_run, after_wait):
        rf = after["timings"]["ridgefill"]
        assert rf["resumed"] == 0 and after["timings"]["cache_n"] == start and rf["rows"] == rf_fresh["rows"]
        assert top_logprob_gap(after, fresh) < STOCK_NOISE
    assert stock["timings"]["cache_n"] <= start


def test_a_kv_mode_whose_server_cannot_start_is_reported_as_not_run_while_the_others_are_written(
        smollm2_with_maps, tmp_path, monkeypatch):
    """Separate KV gives every slot a long prompt's cache, which a device may not hold (8 slots of 64K on an H100):
    that server's failure to start is recorded, not fatal. The failure is made here by refusing '-no-kvu'."""
    require_builds("ridgefill")
    from ridgefill_gguf import serving
    from ridgefill_gguf.serve import ServerError

    class NoSeparateKV(Server):
        def start(self):
            if "-no-kvu" in self.args:
                raise ServerError("llama-server exited with status 1 while starting; log: made up by the test")
            return super().start()

    monkeypatch.setattr(serving, "Server", NoSeparateKV)
    model, maps, _ = smollm2_with_maps
    r = serving.run_serving(model, maps, [1024], [2], kv_modes=("separate", "unified"), tail=256, select="none",
                            threads=2, out_dir=tmp_path, label="smollm2", warmup=False, log=lambda *_: None)
    out = json.loads(next(tmp_path.glob("*-smollm2.json")).read_text())
    assert [(n["kv"], n["reason"].split(";")[0]) for n in out["not_run"]] == [
        ("separate", "llama-server exited with status 1 while starting")]
    assert {(c["kv"], c["ridgefill"]) for c in out["cells"]} == {("unified", False), ("unified", True)}
    assert "Not run: separate KV" in next(tmp_path.glob("*-smollm2.md")).read_text() and r["files"]
