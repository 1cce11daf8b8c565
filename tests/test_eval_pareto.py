"""eval pareto: the budget sweep's speed (bench) against quality (eval report), joined by configuration."""
from __future__ import annotations

import json

import pytest

from ridgefill_gguf import advise as A
from ridgefill_gguf.eval.pareto import run_pareto


def bench_result(speedups: dict[str, float], tokens: int = 32768) -> dict:
    """A bench result reduced to what eval pareto reads: plain RidgeFill and the probe at budget factors."""
    plain = speedups.pop("plain")
    return {"tail": 1024, "rows": [{"placement": "resident", "tokens": tokens, "speedup": plain}],
            "selectors": [{"placement": "resident", "tokens": tokens, "selector": s, "probe_rows": 256,
                           "budget_factor": float(s.partition("@")[2]) if "@" in s else None, "speedup_vs_exact": v}
                          for s, v in speedups.items()]}


def needles(split: int, arm: str, budget: float | None, mean: float, n: int = 400) -> dict:
    probe = None if budget is None else {**A.DEFAULT_PROBE, "budget": budget}
    return {"split": split, "tail": 1024, "arm": arm, "probe": probe, "tasks": list(A.NEEDLE_TASKS),
            "lengths": [4096], "n": n, "mean": mean, "bound": mean - 0.01, "floor": -0.0075, "run": f"r{budget}"}


def test_the_pareto_join_marks_the_configurations_no_other_beats_in_both_speed_and_quality(tmp_path):
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps(bench_result({"plain": 2.1, "probe": 1.5, "probe@1.5": 1.3, "probe@2": 1.35})))
    curves = {"m.gguf": {"needles": [needles(15, "ridge", None, -0.6), needles(15, "ridge+probe", 1.0, -0.02),
                                     needles(15, "ridge+probe", 1.5, -0.01), needles(15, "ridge+probe", 2.0, 0.0),
                                     needles(11, "ridge", None, -0.7)]}}
    r = run_pareto([bench], curves, tmp_path / "out")
    (panel,) = r["panels"]  # split 11 has one configuration: no trade to show
    assert (panel["split"], panel["measure"], panel["tokens"]) == (15, "needles", 32768)
    front = {(p["budget"], p["frontier"]) for p in panel["points"]}
    # budget 1.5 is slower than budget 2 and worse: off the frontier
    assert front == {(0.0, True), (1.0, True), (1.5, False), (2.0, True)}
    assert "| 1024 | probe 256, budget 2 | 1.35x |" in (tmp_path / "out" / "pareto.md").read_text()
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 1000


def test_eval_pareto_refuses_a_bench_and_study_with_nothing_in_common(tmp_path):
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({**bench_result({"plain": 2.0, "probe": 1.4}), "tail": 4096}))
    curves = {"m.gguf": {"needles": [needles(15, "ridge", None, -0.6), needles(15, "ridge+probe", 1.0, -0.02)]}}
    with pytest.raises(ValueError, match="join is by tail, probe rows and budget factor"):
        run_pareto([bench], curves, tmp_path / "out")


def test_a_budget_of_zero_is_its_own_point_and_each_bench_keeps_its_own_panels(tmp_path):
    benches = []
    for name, speedups in (("a", {"plain": 2.1, "probe": 1.5, "probe@0": 2.0}), ("b", {"plain": 1.8, "probe": 1.3})):
        benches.append(tmp_path / f"{name}.json")
        benches[-1].write_text(json.dumps({**bench_result(speedups), "model": f"/x/{name}.gguf", "split": 13}))
    curves = {"m.gguf": {"needles": [needles(15, "ridge", None, -0.6), needles(15, "ridge+probe", 1.0, -0.02),
                                     needles(15, "ridge+probe", 0.0, -0.5)]}}
    first, second = run_pareto(benches, curves, tmp_path / "out")["panels"]
    # the probe at budget 0 is its own point, not the server's budget
    assert {(p["probe_rows"], p["budget"]): p["speedup"] for p in first["points"]} == \
        {(0, 0.0): 2.1, (256, 1.0): 1.5, (256, 0.0): 2.0}
    assert (first["speed_from"], second["speed_from"]) == ("a.gguf, split 13", "b.gguf, split 13")


def loss(arm: str, budget: float | None, mean: float, hi: float) -> dict:
    probe = None if budget is None else {**A.DEFAULT_PROBE, "budget": budget}
    return {"split": 12, "tail": 1024, "arm": arm, "probe": probe, "n": 12, "mean": mean, "lo": mean - 0.1,
            "hi": hi, "all_mean": mean / 10, "run": f"nll{budget}"}


def test_the_key_token_loss_is_a_panel_of_its_own_where_the_lower_loss_is_the_better_one(tmp_path):
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps(bench_result({"plain": 2.1, "probe": 1.5, "probe@1.5": 1.3, "probe@2": 1.35})))
    curves = {"m.gguf": {"nll": [loss("ridge", None, 1.65, 1.9), loss("ridge+probe", 1.0, 0.14, 0.34),
                                 loss("ridge+probe", 1.5, 0.20, 0.30), loss("ridge+probe", 2.0, 0.05, 0.09)]}}
    (panel,) = run_pareto([bench], curves, tmp_path / "out")["panels"]
    assert panel["measure"] == "key-token ΔNLL"
    # budget 1.5 is slower than budget 2 and loses more: off the frontier; the larger losses of faster ones are on it
    assert {(p["budget"], p["frontier"]) for p in panel["points"]} == \
        {(0.0, True), (1.0, True), (1.5, False), (2.0, True)}
    assert {p["budget"]: p["bound"] for p in panel["points"]}[2.0] == 0.09  # the interval's upper end
    assert "| 1024 | probe 256, budget 2 | 1.35x | +0.050 (+0.090) | 12 | * | nll2.0 |" in \
        (tmp_path / "out" / "pareto.md").read_text()


def test_benches_of_one_model_and_split_are_one_sweep_whose_first_named_bench_keeps_a_configuration_both_timed(
        tmp_path):
    budgets = {**bench_result({"plain": 2.11, "probe@1": 1.43, "probe@1.5": 1.29}), "model": "/x/8b.gguf", "split": 13}
    tail512 = {**bench_result({"plain": 2.16, "probe@1.5": 1.31}), "model": "/x/8b.gguf", "split": 13, "tail": 512}
    rows = {**bench_result({"plain": 2.09, "probe@1.5": 1.20}), "model": "/x/8b.gguf", "split": 13}
    rows["selectors"][0]["probe_rows"] = 1024
    paths = []
    for name, b in (("budgets", budgets), ("tail512", tail512), ("rows", rows)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(b))
    curves = {"m.gguf": {"nll": [loss("ridge", None, 1.65, 1.9), loss("ridge+probe", 1.0, 0.14, 0.34),
                                 loss("ridge+probe", 1.5, 0.10, 0.20), {**loss("ridge", None, 1.5, 1.7), "tail": 512},
                                 {**loss("ridge+probe", 1.5, 0.12, 0.22), "tail": 512},
                                 {**loss("ridge+probe", 1.5, 0.08, 0.15), "probe": {**A.DEFAULT_PROBE, "budget": 1.5,
                                                                                    "probe_rows": 1024}}]}}
    (panel,) = run_pareto(paths, curves, tmp_path / "out")["panels"]
    got = {(p["tail"], p["probe_rows"], p["budget"]): p["speedup"] for p in panel["points"]}
    # plain RidgeFill at tail 1024 from the budgets bench, named first; the other settings from their own benches
    assert got == {(1024, 0, 0.0): 2.11, (1024, 256, 1.0): 1.43, (1024, 256, 1.5): 1.29, (512, 0, 0.0): 2.16,
                   (512, 256, 1.5): 1.31, (1024, 1024, 1.5): 1.20}
