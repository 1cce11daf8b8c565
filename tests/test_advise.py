"""ridgefill-gguf advise: speed measured here, quality from the committed studies, the fastest configuration within
the user's margin."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, require_builds, tiny_qwen3_with_random_maps
from ridgefill_gguf import advise as A


def test_the_packaged_quality_curves_are_what_the_committed_studies_give():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "quality_curves.py"), "--check"], text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    curves = A.load_curves()["models"]
    smol = A.quality_of(curves["SmolLM2-135M-Instruct.Q4_1.gguf"]["needles"], 15, 1024, "ridge+probe")
    # the default selector's largest committed run, not the one without whole numbers or with another budget
    assert smol["run"].endswith("claim-smollm2-S15-T1024-whole") and smol["n"] == 1095
    assert A.quality_of(curves["SmolLM2-135M-Instruct.Q4_1.gguf"]["needles"], 11, 1024, "ridge+probe") is None


def bench_like(plain: float, probe: float, share: float = 0.8) -> dict:
    """What run_bench returns, reduced to what advise reads."""
    return {"rows": [{"tokens": 1024, "speedup": plain, "share_of_ceiling": share, "ceiling_macs": plain / share,
                      "median_ridgefill_ms": 100 / plain, "median_exact_ms": 100.0}],
            "selectors": [{"selector": "probe", "speedup_vs_exact": probe, "share_of_ceiling": share,
                           "ceiling_macs": probe / share, "selected": 100, "prefix": 400, "probe_rows": 256,
                           "median_ms": 100 / probe}]}


def entry(split: int, tail: int, arm: str, bound: float, n: int = 300, hi: float = 0.05, **more) -> dict:
    floor = -(1 - 0.05 ** (1 / n))  # the binomial floor, as eval report writes it
    return {"split": split, "tail": tail, "arm": arm, "probe": A.DEFAULT_PROBE if arm != "ridge" else None,
            "tasks": list(A.NEEDLE_TASKS), "lengths": [4096], "n": n, "mean": bound / 2, "hi": hi,
            "bound": min(bound, floor), "floor": floor, "run": f"run-{arm}", **more}


def test_advise_takes_the_fastest_configuration_whose_committed_bound_holds_the_margin(tmp_path):
    model, maps = tiny_qwen3_with_random_maps(tmp_path)
    curves = {model.name: {"signature": None, "needles": [entry(1, 64, "ridge", -0.40),
                                                          entry(1, 64, "ridge+probe", -0.015)]}}

    def run(margin: float) -> dict:
        return A.advise(model, [maps], tokens=8192, margin=margin, tails=(64,), measure_tokens=1024, curves=curves,
                        out_dir=tmp_path / f"out-{margin}", measure=lambda m, t: bench_like(1.9, 1.4), log=print)

    strict, loose = run(0.02), run(0.5)
    assert (strict["choice"]["arm"], loose["choice"]["arm"]) == ("ridge+probe", "ridge")
    assert strict["quality_from"] == model.name
    at = {c["arm"]: c["speed"]["at_tokens"] for c in strict["candidates"]}
    # carried to the served length by the share of the MAC ceiling: the ceiling grows with the prompt
    assert at["ridge"]["speedup"] > 1.9 and at["ridge+probe"]["speedup"] < at["ridge"]["speedup"]
    slower = A.advise(model, [maps], tokens=1100, margin=0.5, tails=(64,), measure_tokens=1024, curves=curves,
                      out_dir=tmp_path / "slower", measure=lambda m, t: bench_like(0.7, 0.5, share=0.3), log=print)
    assert slower["choice"] is None and "not faster than the stock prefill" in slower["why_none"]
    # facts asked in other words count once a run has the samples to test the margin, or shows a clear loss
    def with_facts(**test) -> dict:
        return {model.name: {**curves[model.name], "facts": [entry(1, 64, "ridge+probe", turn="first", **test)]}}

    picks = {name: A.advise(model, [maps], tokens=8192, margin=0.02, tails=(64,), measure_tokens=1024,
                            curves=with_facts(**test), out_dir=tmp_path / name,
                            measure=lambda m, t: bench_like(1.9, 1.4), log=print)["choice"]
             for name, test in {"few": dict(bound=-0.30, n=20, hi=0.1), "clear": dict(bound=-0.60, n=20, hi=-0.1),
                                "many": dict(bound=-0.30, n=400)}.items()}
    assert picks["few"]["arm"] == "ridge+probe" and picks["clear"] is None and picks["many"] is None
    assert "too few to test" in (tmp_path / "few" / "advice.md").read_text()
    md = (tmp_path / "out-0.02" / "advice.md").read_text()
    # no follow-up measured: the server's default reuse, which prefills a follow-up again for its own question
    assert "--ridgefill-tail 64 --ridgefill-select probe --ridgefill-budget 1 --ridgefill-reuse exact-only" in md
    assert "No follow-up measured for this configuration: the server's default reuse (exact-only)." in md
    assert json.loads((tmp_path / "out-0.5" / "advice.json").read_text())["choice"]["arm"] == "ridge"


def test_advise_without_a_committed_study_of_the_model_recommends_nothing_and_says_why(tmp_path):
    model, maps = tiny_qwen3_with_random_maps(tmp_path)
    lines: list[str] = []
    r = A.advise(model, [maps], tokens=8192, margin=0.02, tails=(64,), measure_tokens=1024,
                 curves=A.load_curves()["models"], out_dir=tmp_path / "out",
                 measure=lambda m, t: bench_like(1.9, 1.4), log=lines.append)
    assert r["choice"] is None and r["quality_from"] is None
    assert any("no committed quality" in s for s in lines)
    assert all("no committed retrieval for this configuration" in c["notes"] and c["reuse"] == "exact-only" and
               "no follow-up measured for this configuration: the server's default reuse (exact-only)" in c["notes"]
               for c in r["candidates"])
    assert "serve the stock prefill" in (tmp_path / "out" / "advice.md").read_text()


def test_advise_measures_plain_ridgefill_and_the_default_selector_through_llama_server(tmp_path):
    require_builds("ridgefill")
    model, maps = tiny_qwen3_with_random_maps(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "ridgefill_gguf.cli", "advise", str(model), "--maps", str(maps),
                           "--tokens", "4096", "--tail", "64", "--measure-tokens", "700", "-t", "2",
                           "--out", str(tmp_path / "out")], text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "out" / "advice.json").read_text())
    measured = {c["arm"]: c["speed"]["measured"] for c in r["candidates"]}
    assert set(measured) == {"ridge", "ridge+probe"}
    assert all(m["speedup"] > 0 and 0 < m["share_of_ceiling"] for m in measured.values())
    assert 0 < measured["ridge+probe"]["exact_share"] < 1
    assert list((tmp_path / "out" / "bench").glob("*.json"))  # the measurement's own result files
    assert "RidgeFill advice" in proc.stdout


def test_advise_refuses_a_measurement_too_short_for_its_tail(tmp_path):
    model, maps = tiny_qwen3_with_random_maps(tmp_path)
    with pytest.raises(ValueError, match=r"--measure-tokens \(1024\) must exceed the largest tail \(1024\)"):
        A.advise(model, [maps], tokens=8192, margin=0.02, tails=(1024,), measure_tokens=1024, curves={},
                 out_dir=tmp_path / "out", measure=lambda m, t: bench_like(1.9, 1.4))
    # the command says so in one line, as it does for two served lengths
    for args, said in ((["--tail", "4096"], "must exceed the largest tail"), (["--tokens", "16k,32k"], "one length")):
        proc = subprocess.run([sys.executable, "-m", "ridgefill_gguf.cli", "advise", str(model), "--maps", str(maps),
                               *args, "--out", str(tmp_path / "cli")], text=True, capture_output=True, timeout=300)
        assert proc.returncode != 0 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_quality_study_whose_runs_are_not_there_is_refused_by_name(tmp_path):
    study = {"m.gguf": {"needles": [{"split": 1, "tail": 64, "lengths": [1024], "path": "gone/needles-m",
                                     "noninferiority": {}}]}}
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "study.json").write_text(json.dumps(study))
    with pytest.raises(ValueError, match="names the run .*needles-m, whose summary.json is not there"):
        A.curves_of_file(tmp_path / "report" / "study.json")


def test_advise_names_the_budget_and_the_reuse_policy_whose_natural_follow_up_holds_the_margin(tmp_path):
    model, maps = tiny_qwen3_with_random_maps(tmp_path)
    budget2 = {**A.DEFAULT_PROBE, "budget": 2.0}

    def fact(turn: str, bound: float, probe: dict = A.DEFAULT_PROBE) -> dict:
        return entry(1, 64, "ridge+probe", bound, n=400, turn=turn, probe=probe)

    facts = [fact("first", -0.01), fact("follow_up", -0.13), fact("follow_up_exact_only", -0.06),
             fact("first", -0.005, budget2), fact("follow_up", -0.04, budget2),
             fact("follow_up_exact_only", -0.015, budget2)]
    curves = {model.name: {"signature": None, "facts": facts,
                           "needles": [entry(1, 64, "ridge", -0.40), entry(1, 64, "ridge+probe", -0.015)]}}
    timed = []

    def measure(m, t):
        bench = bench_like(1.9, 1.4)
        bench["selectors"].append({**bench["selectors"][0], "selector": "probe@2", "speedup_vs_exact": 1.1,
                                   "selected": 300, "median_ms": 100 / 1.1})
        timed.append(t)
        return bench

    def run(margin: float) -> dict:
        return A.advise(model, [maps], tokens=8192, margin=margin, tails=(64,), measure_tokens=1024, curves=curves,
                        out_dir=tmp_path / f"out-{margin}", measure=measure, log=print)

    tight, middle, loose = run(0.02), run(0.07), run(0.15)
    ch = tight["choice"]
    assert (ch["arm"], ch["budget"], ch["reuse"]) == ("ridge+probe", 2.0, "exact-only")
    assert ch["quality"]["from_budget"] == 1.0  # budget 2 has no needles run: the default's, a subset of its rows
    md = (tmp_path / "out-0.02" / "advice.md").read_text()
    assert "--ridgefill-budget 2 --ridgefill-reuse exact-only" in md
    assert "facts asked in other words: first question -0.2 (bound -0.7), follow-up -0.8 (bound -1.5)" in md
    # a looser margin lets the faster default budget serve, its follow-ups prefilled again or over the cache
    assert (middle["choice"]["budget"], middle["choice"]["reuse"]) == (1.0, "exact-only")
    assert (loose["choice"]["budget"], loose["choice"]["reuse"]) == (1.0, "any")
    policies = {(c["arm"], c["budget"], c["reuse"]) for c in tight["candidates"]}
    assert policies == {("ridge", None, "exact-only"), ("ridge+probe", 1.0, "any"), ("ridge+probe", 1.0, "exact-only"),
                        ("ridge+probe", 2.0, "any"), ("ridge+probe", 2.0, "exact-only")}
    assert timed == [64, 64, 64]


def test_advise_names_the_rerank_policy_where_only_the_follow_up_that_keeps_the_first_exact_rows_holds(tmp_path):
    model, maps = tiny_qwen3_with_random_maps(tmp_path)

    def fact(turn: str, bound: float) -> dict:
        return entry(1, 64, "ridge+probe", bound, n=400, turn=turn, probe=A.DEFAULT_PROBE)

    facts = [fact("first", -0.01), fact("follow_up", -0.13), fact("follow_up_exact_only", -0.06),
             fact("follow_up_rerank", -0.012)]
    curves = {model.name: {"signature": None, "facts": facts,
                           "needles": [entry(1, 64, "ridge", -0.40), entry(1, 64, "ridge+probe", -0.015)]}}

    def run(margin: float) -> dict:
        return A.advise(model, [maps], tokens=8192, margin=margin, tails=(64,), measure_tokens=1024, curves=curves,
                        out_dir=tmp_path / f"out-{margin}", measure=lambda m, t: bench_like(1.9, 1.4), log=print)

    tight, loose = run(0.02), run(0.15)
    assert (tight["choice"]["budget"], tight["choice"]["reuse"]) == (1.0, "rerank")
    assert "--ridgefill-reuse rerank" in (tmp_path / "out-0.02" / "advice.md").read_text()
    # where every policy holds, the one whose follow-ups cost least: over the reused cache
    assert loose["choice"]["reuse"] == "any"
    assert {c["reuse"] for c in tight["candidates"] if c["arm"] == "ridge+probe"} == {"any", "exact-only", "rerank"}


def test_advise_shows_the_committed_key_token_loss_beside_each_configuration_without_choosing_on_it(tmp_path):
    model, maps = tiny_qwen3_with_random_maps(tmp_path)
    needles = [entry(1, 64, "ridge", -0.40), entry(1, 64, "ridge+probe", -0.015)]
    nll = [{"split": 1, "tail": 64, "arm": "ridge+probe", "probe": A.DEFAULT_PROBE, "n": 12, "mean": 0.144,
            "lo": 0.01, "hi": 0.345, "all_mean": 0.017, "run": "nll-run"}]
    r = A.advise(model, [maps], tokens=8192, margin=0.02, tails=(64,), measure_tokens=1024,
                 curves={model.name: {"signature": None, "needles": needles, "nll": nll}}, out_dir=tmp_path / "out",
                 measure=lambda m, t: bench_like(1.9, 1.4), log=print)
    loss = {c["arm"]: c["loss"] for c in r["candidates"]}
    assert loss["ridge"] is None and loss["ridge+probe"]["mean"] == 0.144
    md = (tmp_path / "out" / "advice.md").read_text()
    assert "| +0.144 (+0.345), 12 |" in md and "| not measured |" in md
    assert "key tokens' loss +0.144 nats per token (95% upper +0.345) in `nll-run`" in md


def test_a_model_with_only_a_committed_loss_gets_no_advice_and_is_told_that_no_retrieval_was_measured(tmp_path):
    model, maps = tiny_qwen3_with_random_maps(tmp_path)
    nll = [{"split": 1, "tail": 64, "arm": "ridge+probe", "probe": A.DEFAULT_PROBE, "n": 6, "mean": 0.09,
            "lo": -0.05, "hi": 0.23, "all_mean": 0.009, "run": "nll-run"}]
    r = A.advise(model, [maps], tokens=8192, margin=0.02, tails=(64,), measure_tokens=1024,
                 curves={model.name: {"signature": None, "needles": [], "nll": nll}}, out_dir=tmp_path / "out",
                 measure=lambda m, t: bench_like(1.9, 1.4), log=print)
    assert r["choice"] is None and r["why_none"].startswith("no committed retrieval (eval needles) of this model")
    assert "| +0.090 (+0.230), 6 |" in (tmp_path / "out" / "advice.md").read_text()


def test_the_packaged_curves_hold_the_key_token_loss_of_the_committed_nll_runs_with_their_probe_settings():
    qwen = A.load_curves()["models"]["qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"]["nll"]
    of_run = {e["arm"]: e for e in qwen if e["run"].endswith("selectors-nll-qwen-S12-T1024")}
    probe, plain = of_run["ridge+probe"], of_run["ridge"]
    assert (probe["split"], probe["tail"], probe["n"]) == (12, 1024, 6)
    # that run predates whole numbers: its settings say so, and so it does not speak for today's default
    assert probe["probe"]["budget"] == 1.0 and probe["probe"]["whole_numbers"] is False and plain["probe"] is None
    assert not A.default_like(probe)
    # the probe loses far less on the key tokens than plain RidgeFill
    assert 0 < probe["mean"] < plain["mean"]
