"""The quality instruments: bootstrap, token masks, the scorer, and `eval nll` end to end on a tiny model."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, assert_same_bytes, require_builds, tiny_qwen3_with_random_maps
from ridgefill_gguf.eval.stats import binomial_floor, bootstrap_mean, noninferiority
from ridgefill_gguf.eval.tokens import key_mask, novel_mask, token_nll


def word_documents(folder, n: int, seed: int):
    """n documents of 500 random Greek-letter words."""
    folder.mkdir()
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
    rng = np.random.default_rng(seed)
    for i in range(n):
        (folder / f"d{i}.txt").write_text(" ".join(rng.choice(words, size=500)) + "\n")
    return folder


def test_the_bootstrap_interval_covers_a_known_mean_and_is_reproducible():
    rng = np.random.default_rng(5)
    x = rng.normal(0.3, 1.0, size=400)
    s = bootstrap_mean(x)
    assert s["n"] == 400 and s["lo"] < 0.3 < s["hi"] and s["mean"] == pytest.approx(x.mean())
    assert s["hi"] - s["lo"] == pytest.approx(2 * 1.96 / np.sqrt(400), rel=0.15)
    assert bootstrap_mean(x) == s  # fixed seed
    const = bootstrap_mean([0.25] * 7)
    assert const["lo"] == const["hi"] == const["mean"] == const["median"] == 0.25
    assert bootstrap_mean([])["n"] == 0 and bootstrap_mean([np.nan, 1.0])["n"] == 1


def test_the_noninferiority_bound_is_the_binomial_floor_when_the_arms_agree_on_every_sample():
    assert 100 * binomial_floor(138) == pytest.approx(-2.15, abs=0.005)  # paper §3.4's Qwen3-8B figure
    agree = noninferiority([0.0] * 61, 0.02)
    assert agree["bootstrap_bound"] == 0.0 and agree["bound"] == agree["floor"] == pytest.approx(-0.0479, abs=1e-4)
    assert not agree["holds"]  # 61 samples cannot show a 2-point margin
    assert noninferiority([0.0] * 200, 0.02)["holds"]
    worse = noninferiority([-0.1] * 200, 0.02)
    assert worse["bound"] == pytest.approx(-0.1) and not worse["holds"]
    assert noninferiority([], 0.02)["n"] == 0 and not noninferiority([], 0.02)["holds"]


def test_resampling_within_each_task_keeps_the_task_mix_so_task_differences_add_no_spread():
    # two tasks whose values differ only between the tasks: every resample within tasks has the same mean
    values, tasks = [0.0] * 30 + [1.0] * 10, ["single"] * 30 + ["multikey"] * 10
    within = bootstrap_mean(values, strata=tasks)
    assert within["lo"] == pytest.approx(within["hi"]) == pytest.approx(0.25)
    pooled = bootstrap_mean(values)
    assert pooled["hi"] - pooled["lo"] > 0.2  # resampling across tasks mixes them differently each time
    # within a task it is the plain bootstrap of that task's values
    rng = np.random.default_rng(3)
    x = rng.normal(0.0, 1.0, size=50)
    one = bootstrap_mean(x, strata=["single"] * 50)
    assert one["hi"] - one["lo"] == pytest.approx(2 * 1.96 / np.sqrt(50), rel=0.2)
    # a non-finite value drops with its task label
    assert bootstrap_mean([np.nan, 0.5, 0.5], strata=["a", "b", "b"])["n"] == 2
    # a stratum of one value cannot vary, so the strata are not used and the interval stays honest
    lone = bootstrap_mean(values + [5.0], strata=tasks + ["multiquery"])
    assert lone == bootstrap_mean(values + [5.0]) and lone["hi"] - lone["lo"] > 0.2
    test = noninferiority(values, 0.02, strata=tasks)
    assert test["bootstrap_bound"] == pytest.approx(0.25) and test["bound"] == test["floor"]


def test_a_token_inside_an_8_token_run_seen_earlier_is_not_novel():
    run = list(range(100, 108))
    tokens = run + [1, 2, 3] + run + [4, 5]
    m = novel_mask(tokens, 0)
    assert m[:11].all()                   # the first occurrence and what follows are novel
    assert not m[11:19].any()             # the repeated run
    assert m[19:].all()
    assert novel_mask(tokens, 15).tolist() == m[15:].tolist()
    # seven repeated tokens are not a run of eight
    assert novel_mask(run[:7] + [0] + run[:7], 0).all()


def test_key_tokens_are_those_whose_loss_rises_by_more_than_two_nats_without_the_prefix():
    assert key_mask([1.0, 1.0, 0.5], [3.5, 3.0, 2.4]).tolist() == [True, False, False]


def test_token_nll_is_the_negative_log_softmax_of_the_target():
    logits = np.array([[0.0, 1.0, 2.0], [5.0, 5.0, 5.0]])
    want = [np.log(np.exp([0, 1, 2]).sum()) - 1.0, np.log(3.0)]
    assert np.allclose(token_nll(logits, [1, 0]), want)


def test_documents_are_taken_across_domains_in_turn_so_max_docs_samples_every_domain(tmp_path):
    from ridgefill_gguf.eval.documents import across_domains
    for dom, names in {"chat": ["a", "b", "c"], "code": ["d"], "prose": ["e", "f"]}.items():
        (tmp_path / dom).mkdir()
        for n in names:
            (tmp_path / dom / f"{n}.txt").write_text(n)
    order = [f.stem for f in across_domains([tmp_path])]
    assert order == ["a", "d", "e", "b", "f", "c"]


def test_eval_nll_scores_documents_resumes_and_plumb_costs_nothing(tmp_path):
    require_builds("ridgefill")
    from ridgefill_gguf.eval.arms import SelectorOptions
    from ridgefill_gguf.eval.nll import NllOptions, run_nll
    from ridgefill_gguf.maps.synthetic import write_random_maps
    from ridgefill_gguf.random_gguf import tiny_shape, write_random_model

    model = write_random_model(tmp_path / "m.gguf", dataclasses.replace(tiny_shape("qwen3"), n_layer=4), seed=9)
    maps = write_random_maps(model, 1, tmp_path / "maps.gguf")
    docs = word_documents(tmp_path / "docs", 3, seed=1)
    (docs / "short.txt").write_text("too short\n")
    opts = NllOptions(arms=("plumb", "ridge", "none", "ridge+probe", "ridge+random:probe"), tail=128, score=64,
                      min_tokens=300, max_tokens=600, threads=2, flash_attn=False,
                      selectors=SelectorOptions(probe_share=0.1, probe_rows=32))
    logs = []
    r = run_nll(model, maps, [docs], tmp_path / "out", opts, log=logs.append)
    assert r["documents"] == 3 and any("skip short.txt" in line for line in logs)
    rows = [json.loads(x) for x in (tmp_path / "out" / "documents.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(row["counts"]["all"] == 64 for row in rows)
    # plumb runs every row exactly through the RidgeFill path: no loss
    assert abs(r["summary"]["plumb"]["all"]["mean"]) < 1e-4
    assert r["summary"]["ridge"]["all"]["n"] == 3 and r["summary"]["ridge+probe"]["all"]["n"] == 3
    for row in rows:  # the probe and its count-matched control ran with the same number of exact rows
        assert row["rows"]["ridge+probe"]["n_exact"] == row["rows"]["ridge+random:probe"]["n_exact"] > 10
        # and each row says what chose them: the probe's pass here (a fixed share), the random draw there
        probe, rand = row["rows"]["ridge+probe"], row["rows"]["ridge+random:probe"]
        assert probe["n_probe_exact"] > 0 and rand["n_random"] == probe["n_probe_exact"] and rand["n_probe_exact"] == 0
    assert all(f"| d{i}.txt | " in (tmp_path / "out" / "summary.md").read_text() for i in range(3))
    assert (tmp_path / "out" / "summary.png").exists()
    # a second run finds everything done
    logs.clear()
    run_nll(model, maps, [docs], tmp_path / "out", opts, log=logs.append)
    assert any("resuming, 3 documents done" in line for line in logs)
    assert not any(line.startswith("eval nll: document") for line in logs)


def test_ruler_string_match_all_counts_the_share_of_expected_values_found():
    from ridgefill_gguf.eval.needles import ruler_string_match_all

    assert ruler_string_match_all("The number is 1234567.", ["1234567"]) == 1.0
    assert ruler_string_match_all("the numbers are 111 and 333", ["111", "222", "333", "444"]) == 0.5
    assert ruler_string_match_all("Nothing here", ["7654321"]) == 0.0
    assert ruler_string_match_all("KEY-Word", ["key-word"]) == 1.0  # case-insensitive, as RULER


def test_a_sample_is_filled_region_only_when_every_needle_lies_before_the_tail():
    from ridgefill_gguf.eval.needles import Sample

    s = Sample("single-4096-0", "multikey", 4096, 4000, ["1"], [[100, 120], [2900, 2920]], "x")
    assert s.filled_region(1024)            # both end by row 2976
    assert not s.filled_region(1100)        # the second needle ends at 2920 > 4000 - 1100
    assert Sample("a", "single", 10, 10, ["1"], [[8, 10]], "x").filled_region(0)


def test_the_needle_table_counts_whole_and_split_needles_before_the_tail_and_who_retrieved_them(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("needle_rows", ROOT / "tools" / "needle_rows.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    # 100 tokens, tail 20 (the prefill's n_tail 19): rows from 80 on are the tail; the third needle lies there
    sample = {"sample_id": "multivalue-100-0", "task": "multivalue", "length": 100, "n_tokens": 100,
              "answers": ["111", "222", "333"], "needle_rows": [[10, 14], [40, 44], [85, 89]], "prompt_sha": "x"}
    answers = [{"sample": "multivalue-100-0", "arm": "exact", "pred": "111, 222 and 333", "stats": {}},
               {"sample": "multivalue-100-0", "arm": "ridge+probe", "pred": "111 and 333",
                "stats": {"n_tail": 19, "needle_rows_exact": [4, 2, 4]}}]
    (tmp_path / "samples.jsonl").write_text(json.dumps(sample) + "\n")
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
    assert tool.needle_table(tmp_path, "ridge+probe") == {"whole": {"needles": 1, "arm": 1, "exact": 1},
                                                          "split": {"needles": 1, "arm": 0, "exact": 1}}


def test_a_sample_counts_per_needle_the_rows_that_ran_exactly():
    from ridgefill_gguf.eval.needles import Sample

    s = Sample("multivalue-4096-0", "multivalue", 4096, 4000, ["1", "2"], [[100, 104], [200, 203]], "x")
    assert s.needle_rows_exact([0, 99, 100, 103, 104, 201, 3000], 3000) == [2, 1]  # ends are exclusive
    assert s.needle_rows_exact([], 3000) == [0, 0]
    assert s.needle_rows_exact([100], 201) == [1, 2]  # rows from the tail's first on ran exactly


def test_needle_prompts_have_the_asked_length_and_put_each_needle_where_the_sample_says():
    from ridgefill_gguf.eval.needles import TASKS, PromptBuilder

    def tokenize(text: str) -> list[str]:  # a word tokenizer stands in for the model's
        return ["<bos>"] + text.split()

    builder = PromptBuilder(tokenize, None)
    for task in TASKS:
        sample, tokens = builder.build(task, 3000, 0, seed=7)
        assert abs(len(tokens) - 3000) <= 30 and sample.n_tokens == len(tokens)
        for first, end in sample.needle_rows:
            assert tokens[first:first + 6] == ["One", "of", "the", "special", "magic", "numbers"]
            assert tokens[end - 1].rstrip(".").isdigit()
        assert all(a in " ".join(tokens) for a in sample.answers)
        again, _ = builder.build(task, 3000, 0, seed=7)
        other, _ = builder.build(task, 3000, 1, seed=7)
        assert again == sample and other.answers != sample.answers
    assert builder.build("multivalue", 3000, 0, seed=7)[0].answers.__len__() == 4
    chat = PromptBuilder(tokenize, lambda msg: f"<user> {msg} <assistant>")
    _, tokens = chat.build("single", 1000, 0, seed=1)
    assert tokens[1] == "<user>" and "<assistant>The" in tokens  # the answer prefix opens the assistant turn


def _tiny_model_and_maps(tmp_path):
    return tiny_qwen3_with_random_maps(tmp_path)


def test_eval_needles_runs_every_arm_none_included_resumes_and_plumb_answers_as_exact(tmp_path):
    require_builds("ridgefill")
    from ridgefill_gguf.eval.needles import NeedleOptions, run_needles

    model, maps = _tiny_model_and_maps(tmp_path)
    opts = NeedleOptions(tasks=("single", "multiquery"), lengths=(700,), samples=2, tails=(128,),
                         arms=("plumb", "ridge", "identity", "none"), fmt="completion", threads=2, flash_attn=False)
    logs = []
    r = run_needles(model, [maps], tmp_path / "out", opts, log=logs.append)
    answers = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert len(answers) == 4 * 5  # 4 samples x (exact + 4 arms)
    by = {(a["sample"], a["arm"]): a for a in answers}
    for sample in ("single-700-0", "single-700-1", "multiquery-700-0", "multiquery-700-1"):
        assert by[(sample, "plumb")]["stats"]["applied"] == 1
        assert by[(sample, "plumb")]["pred"] == by[(sample, "exact")]["pred"]
        assert by[(sample, "ridge")]["stats"]["n_filled"] > 0
        assert by[(sample, "none")]["stats"]["applied"] == 1 and by[(sample, "none")]["stats"]["n_filled"] > 0
    group = r["configs"]["S1-T128"]["groups"]["all tasks"]
    assert group["samples"] == 4 and group["arms"]["plumb"]["delta_filled"]["n"] == group["filled_samples"]
    assert (tmp_path / "out" / "summary.png").exists()
    assert "| 1 | 128 | all tasks | 4 (" in (tmp_path / "out" / "summary.md").read_text()
    logs.clear()
    run_needles(model, [maps], tmp_path / "out", opts, log=logs.append)
    assert any("resuming, 20 answers done" in line for line in logs)
    assert len((tmp_path / "out" / "results.jsonl").read_text().splitlines()) == 20


def test_eval_needles_shards_side_by_side_answer_every_sample_once_and_a_whole_pass_only_summarizes(tmp_path):
    require_builds("ridgefill")
    model, maps = _tiny_model_and_maps(tmp_path)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ridgefill_gguf.cli", "eval", "needles", str(model), "--maps", str(maps),
           "--out", str(out), "--tasks", "single", "--lengths", "700", "--samples", "5", "--tail", "128",
           "--arms", "ridge", "--format", "completion", "-t", "1"]
    shards = [subprocess.Popen(cmd + ["--shard", f"{i}/2"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for p in shards:
        log = p.communicate(timeout=600)[0]
        assert p.returncode == 0, log[-3000:]
    answers = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((a["sample"], a["arm"]) for a in answers) == sorted(
        (f"single-700-{i}", arm) for i in range(5) for arm in ("exact", "ridge"))
    whole = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    assert "resuming, 10 answers done" in whole.stdout + whole.stderr
    assert len((out / "results.jsonl").read_text().splitlines()) == 10  # nothing answered twice
    assert len((out / "samples.jsonl").read_text().splitlines()) == 5
    assert "| 1 | 128 | all tasks | 5 (" in (out / "summary.md").read_text()
    bad = subprocess.run(cmd + ["--shard", "2/2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--shard" in bad.stderr


def test_arms_name_a_fill_a_selector_or_a_random_control_that_follows_its_selector():
    from ridgefill_gguf.eval.arms import Arm, SelectorOptions, arm_params, parse_arms

    arms = parse_arms(["ridge", "ridge+probe", "identity+attention", "ridge+random:probe"])
    assert arms[1] == Arm("ridge+probe", "ridge", selector="probe")
    assert arms[3] == Arm("ridge+random:probe", "ridge", random_of="probe")
    for bad in (["ridge+random:probe"], ["fast"], ["ridge+magic"]):
        with pytest.raises(ValueError):
            parse_arms(bad)
    sel = SelectorOptions(exact_share=0.1, probe_share=0.1, probe_rows=128)
    assert arm_params(arms[1], 1040, 40, sel, {})["probe"] == (128, 100)
    budgeted = arm_params(arms[1], 1040, 40, SelectorOptions(budget=0.5, probe_rows=64), {})
    assert budgeted["probe_budget"] == (64, 0.5) and budgeted["probe"] == (0, 0) and budgeted["protected"] == 0.0
    protected = arm_params(parse_arms(["ridge+protected"])[0], 1040, 40, SelectorOptions(), {})
    assert protected["protected"] == 0.25 and "probe_budget" not in protected
    p = arm_params(arms[3], 1040, 40, sel, {"probe": 97})
    assert p["exact_random"] == (97, 0) and p["probe"] == (0, 0) and p["attention"][1] == 0.0 and not p["blind"]
    blind = arm_params(parse_arms(["ridge+blind-probe"])[0], 1040, 40, sel, {})
    assert blind["blind"] and blind["probe"] == (128, 100) and blind["rescale"] == (512, False, False)
    both = parse_arms(["ridge+probe@both"])[0]
    assert both.selector == "probe" and arm_params(both, 1040, 40, sel, {})["rescale"] == (512, True, True)
    with pytest.raises(ValueError, match="unknown rescale"):
        parse_arms(["ridge@half"])


def test_arms_that_follow_a_continuation_step_by_step_refuse_the_none_fill_by_name():
    from ridgefill_gguf.eval.arms import parse_arms

    with pytest.raises(ValueError, match="fill 'none' cannot follow a continuation"):
        parse_arms(["ridge", "none"], follows=True)
    assert [a.fill for a in parse_arms(["ridge", "none"])] == ["ridge", "none"]  # the loss and needle instruments take it


def test_the_none_fill_answers_token_by_token_from_prefills_that_hide_the_filled_rows_as_numpy(tmp_path):
    require_builds("ridgefill")
    from ridgefill_gguf import libs
    from ridgefill_gguf.engine.session import Session
    from ridgefill_gguf.reference import ReferenceModel

    model, maps = _tiny_model_and_maps(tmp_path)
    libs.use_build("ridgefill")
    sess = Session(model, n_ctx=512, n_batch=64, n_ubatch=32, f32_cache=True, n_threads=2, maps=maps)
    try:
        prompt = sess.tokenize("The heron counts the reeds by the river until the tide turns. " * 12)
        tail, n = 40, 4
        answer, stats = sess.ridgefill_greedy(prompt, n, tail=tail, fill="none", min_prefix=0, exact_rows=[])
        # the same prompt, then a decode step: the step reads the late-layer cells none left unwritten
        logits, _, _ = sess.ridgefill(prompt + answer[:1], tail=tail + 1, fill="none", min_prefix=0, exact_rows=[])
    finally:
        sess.close()
    assert stats["applied"] == 1 and stats["n_filled"] == len(prompt) - tail - 1 and len(answer) == n
    ref = ReferenceModel(model)
    for k in range(n):
        want = ref.ridgefill_forward(prompt + answer[:k], 1, tail + k, "none")[-1]
        assert int(np.argmax(want)) == answer[k]
    step = ref.ridgefill_forward(prompt + answer[:1], 1, tail + 1, "none")[-1]
    assert np.abs(logits - step).max() / np.abs(step).max() > 1e-3, "a decode step would not be the none arm"


def test_eval_needles_runs_a_selector_and_its_count_matched_random_control(tmp_path):
    require_builds("ridgefill")
    from ridgefill_gguf.eval.arms import SelectorOptions
    from ridgefill_gguf.eval.needles import NeedleOptions, run_needles

    model, maps = _tiny_model_and_maps(tmp_path)
    opts = NeedleOptions(tasks=("single",), lengths=(700,), samples=2, tails=(128,),
                         arms=("ridge+probe", "ridge+random:probe", "ridge"), fmt="completion", threads=2,
                         flash_attn=False, selectors=SelectorOptions(probe_share=0.1, probe_rows=32))
    run_needles(model, [maps], tmp_path / "out", opts, log=lambda _: None)
    answers = {(a["sample"], a["arm"]): a for a in
               map(json.loads, (tmp_path / "out" / "results.jsonl").read_text().splitlines())}
    samples = {s["sample_id"]: s
               for s in map(json.loads, (tmp_path / "out" / "samples.jsonl").read_text().splitlines())}
    for i in range(2):
        probe, rand = answers[(f"single-700-{i}", "ridge+probe")], answers[(f"single-700-{i}", "ridge+random:probe")]
        chosen = probe["stats"]["n_probe_exact"]
        assert chosen > 40  # a tenth of the ~570-row prefix
        assert rand["stats"]["n_exact"] - rand["stats"]["n_special"] == chosen
        # the plain arm after them runs without a selector: the engine's parameters were reset
        assert answers[(f"single-700-{i}", "ridge")]["stats"]["n_exact"] == probe["stats"]["n_special"]
        # per needle, the rows that ran exactly: without a selector only a needle in the tail (no needle holds a
        # special token)
        sample = samples[f"single-700-{i}"]
        (first, end), = sample["needle_rows"]
        in_tail = sum(row >= sample["n_tokens"] - 128 for row in range(first, end))
        assert answers[(f"single-700-{i}", "ridge")]["stats"]["needle_rows_exact"] == [in_tail]
        for arm in (probe, rand):
            assert 0 <= arm["stats"]["needle_rows_exact"][0] <= end - first


def test_eval_agreement_gives_plumb_zero_kl_and_full_agreement_and_ridge_some_divergence(tmp_path):
    require_builds("ridgefill")
    from ridgefill_gguf.eval.agreement import AgreementOptions, run_agreement

    model, maps = _tiny_model_and_maps(tmp_path)
    docs = word_documents(tmp_path / "docs", 2, seed=2)
    opts = AgreementOptions(arms=("plumb", "ridge"), tail=128, continue_tokens=32, min_tokens=300, max_tokens=600,
                            threads=2, flash_attn=False)
    r = run_agreement(model, maps, [docs], tmp_path / "out", opts, log=lambda _: None)
    assert r["documents"] == 2
    assert r["summary"]["plumb"]["kl"]["mean"] < 1e-4 and r["summary"]["plumb"]["top1"]["mean"] == 1.0
    assert r["summary"]["ridge"]["kl"]["mean"] > 10 * r["summary"]["plumb"]["kl"]["mean"]
    assert (tmp_path / "out" / "summary.md").exists() and (tmp_path / "out" / "summary.png").exists()
    # which rows ran exactly, per document and arm: ridge the tail (its last row is the stock step after the
    # prefill) and the special rows
    for line in (tmp_path / "out" / "documents.jsonl").read_text().splitlines():
        rows = json.loads(line)["arms"]
        assert rows["ridge"]["rows"]["n_tail"] == 128 - 1 and rows["ridge"]["rows"]["n_filled"] > 100
        assert rows["ridge"]["rows"]["n_exact"] == rows["ridge"]["rows"]["n_special"] >= 1


def test_the_study_report_gathers_runs_across_splits_into_one_table_and_plot(tmp_path):
    from ridgefill_gguf.eval import nll, needles
    from ridgefill_gguf.eval.report import run_report

    rng = np.random.default_rng(0)
    for split in (9, 12):
        rows = [{"name": f"/corpus/{('chat', 'code')[i % 2]}/d{i}.txt",
                 "delta": {arm: {k: float(rng.normal(0.1 * split, 0.01)) for k in nll.KINDS} for arm in nll.ARMS}}
                for i in range(4)]
        out = tmp_path / "study" / ("sweep" if split == 12 else "") / f"nll-S{split}"
        out.mkdir(parents=True)
        (out / "documents.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "summary.json").write_text(json.dumps({
            "instrument": "eval nll", "model": "/m/qwen.gguf", "split": split, "documents": 4,
            "options": {"tail": 1024}, "summary": nll.summarize(rows, nll.ARMS)}))
    samples = [needles.Sample(f"single-4096-{i}", "single", 4096, 4000, ["1"], [[100, 120]], "x") for i in range(3)]
    # exact answers all, ridge the first sample only, identity none
    answers = [{"sample": s.sample_id, "config": c, "arm": a, "score": float(a == "exact" or (a == "ridge" and i == 0))}
               for i, s in enumerate(samples) for c, a in
               [("exact", "exact")] + [(f"S{sp}-T1024", arm) for sp in (9, 12) for arm in needles.ARMS]]
    opts = needles.NeedleOptions(tasks=("single",), tails=(1024,))
    out = tmp_path / "study" / "needles"
    out.mkdir()
    (out / "samples.jsonl").write_text("".join(json.dumps(dataclasses.asdict(x)) + "\n" for x in samples))
    (out / "results.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
    (out / "summary.json").write_text(json.dumps({
        "instrument": "eval needles", "model": "/m/qwen.gguf", "options": {"lengths": [4096]},
        **needles.summarize(samples, answers, {"a": 9, "b": 12}, opts)}))
    study = run_report(tmp_path / "study", tmp_path / "report")
    assert set(study) == {"qwen.gguf"} and len(study["qwen.gguf"]["nll"]) == 2
    md = (tmp_path / "report" / "study.md").read_text()
    assert "| 9 | 1024 | 4 | ridge |" in md and "| 12 | 1024 | 3 (3) | 100.0 | ridge | 33.3 |" in md
    # each loss row names its run, which names the setting where several runs share a split and tail
    assert re.search(r"\| 9 \| 1024 \| 4 \| ridge \|.*\| nll-S9 \|", md)
    # named by its path under the study, so runs in folders of one name stay apart
    assert re.search(r"\| 12 \| 1024 \| 4 \| ridge \|.*\| sweep/nll-S12 \|", md)
    assert (tmp_path / "report" / "study-qwen.png").stat().st_size > 1000
    # the fitted map paired with the identity fill, per sample and per document
    needles_9 = next(x for x in study["qwen.gguf"]["needles"] if x["split"] == 9)
    assert needles_9["pairs"]["ridge - identity"]["accuracy"]["mean"] == pytest.approx(1 / 3)
    assert needles_9["noninferiority"]["ridge"]["n"] == 3  # the filled samples, paired with exact
    nll_12 = next(x for x in study["qwen.gguf"]["nll"] if x["split"] == 12)
    for other in ("identity", "none"):
        want = np.mean([r["delta"]["ridge"]["key"] - r["delta"][other]["key"] for r in rows])
        assert nll_12["pairs"][f"ridge - {other}"]["key"]["mean"] == pytest.approx(want)
    assert "| 9 | 1024 | ridge - identity | needles | 3 samples | retrieval +33.3 [" in md


def test_a_packed_run_reads_as_written_with_rows_appended_since_and_a_facts_run_refuses_to_continue_it(tmp_path):
    from conftest import load_tool
    from ridgefill_gguf.eval.documents import load_jsonl
    from ridgefill_gguf.eval.facts import FactOptions, run_facts

    pack = load_tool("pack_results")
    run = tmp_path / "study" / "facts-x"
    run.mkdir(parents=True)
    rows = [{"sample": f"s{i}", "config": "exact", "arm": "exact", "score": float(i % 2)} for i in range(50)]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "samples.jsonl").write_text("{}\n")  # under the size: left as it is
    assert pack.main([str(tmp_path / "study"), "--min-kb", "1"]) == 0
    assert not (run / "results.jsonl").exists() and (run / "samples.jsonl").read_text() == "{}\n"
    assert load_jsonl(run / "results.jsonl") == rows
    first = (run / "results.jsonl.gz").read_bytes()
    # rows a run appends after packing come after the packed ones
    late = {"sample": "late", "config": "exact", "arm": "exact", "score": 1.0}
    (run / "results.jsonl").write_text(json.dumps(late) + "\n")
    assert load_jsonl(run / "results.jsonl") == rows + [late]
    # a facts run writes its sample list whole, so it would read a packed list twice
    with pytest.raises(ValueError, match=r"packed run \(results.jsonl.gz\).*pack_results.py --unpack"):
        run_facts("model.gguf", [], run, FactOptions())
    assert pack.main([str(tmp_path / "study"), "--unpack"]) == 0
    assert not (run / "results.jsonl.gz").exists() and load_jsonl(run / "results.jsonl") == rows + [late]
    # the same rows pack to the same bytes, and a row both in the packed file and beside it (a copy, or a pack cut
    # between its two writes) counts once
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert pack.main([str(tmp_path / "study"), "--min-kb", "1"]) == 0
    assert_same_bytes((run / "results.jsonl.gz").read_bytes(), first)
    (run / "results.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert load_jsonl(run / "results.jsonl") == rows
    # a study copied to be continued: unpacked, and a file already in the copy stays
    (tmp_path / "work" / "facts-x").mkdir(parents=True)
    (tmp_path / "work" / "facts-x" / "samples.jsonl").write_text("kept\n")
    assert pack.main([str(tmp_path / "study"), str(tmp_path / "work"), "--copy-unpacked"]) == 0
    assert load_jsonl(tmp_path / "work" / "facts-x" / "results.jsonl") == rows
    assert not list((tmp_path / "work").rglob("*.gz"))
    assert (tmp_path / "work" / "facts-x" / "samples.jsonl").read_text() == "kept\n"
    assert pack.main([str(tmp_path / "study"), "--unpack"]) == 0
    assert load_jsonl(run / "results.jsonl") == rows


def test_the_study_report_pairs_a_run_in_a_tagged_folder_with_its_base_run_per_sample_or_document(tmp_path):
    from ridgefill_gguf.eval import needles, nll
    from ridgefill_gguf.eval.report import run_report

    # four samples; the last has its needle in the tail, so only the first three count
    samples = [needles.Sample(f"multivalue-4096-{i}", "multivalue", 4096, 4000, ["1"], [[100 + 3000 * (i == 3), 120 +
                              3000 * (i == 3)]], "x") for i in range(4)]
    opts = needles.NeedleOptions(tasks=("multivalue",), tails=(1024,), arms=("ridge+probe",))

    def write(folder: str, probe_scores: list[float]) -> None:
        answers = [{"sample": s.sample_id, "config": c, "arm": a, "score": 1.0 if a == "exact" else probe_scores[i]}
                   for i, s in enumerate(samples) for c, a in (("exact", "exact"), ("S15-T1024", "ridge+probe"))]
        out = tmp_path / "study" / folder
        out.mkdir(parents=True)
        (out / "samples.jsonl").write_text("".join(json.dumps(dataclasses.asdict(x)) + "\n" for x in samples))
        (out / "results.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
        (out / "summary.json").write_text(json.dumps({
            "instrument": "eval needles", "model": "/m/smollm2.gguf", "options": {"lengths": [4096]},
            **needles.summarize(samples, answers, {"S15-T1024": 15}, opts)}))

    write("claim-S15-T1024", [0.0, 0.5, 1.0, 0.0])
    write("claim-S15-T1024-whole", [1.0, 0.5, 1.0, 1.0])
    write("claim-S15-T10240", [0.0, 0.0, 0.0, 0.0])  # a longer name, not a tag of the base

    # the loss on the same documents: key ΔNLL 0.4 lower with the tag on each document
    def write_nll(folder: str, key: float) -> None:
        rows = [{"name": f"/corpus/chat/d{i}.txt", "delta": {"ridge+probe": {"all": 0.01 * i, "novel": 0.0,
                                                                             "key": key + i}}} for i in range(3)]
        out = tmp_path / "study" / folder
        out.mkdir(parents=True)
        (out / "documents.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "summary.json").write_text(json.dumps({
            "instrument": "eval nll", "model": "/m/smollm2.gguf", "split": 15, "documents": 3,
            "options": {"tail": 1024}, "summary": nll.summarize(rows, ["ridge+probe"])}))

    write_nll("nll-S15-T1024", 1.0)
    write_nll("nll-S15-T1024-whole", 0.6)
    study = run_report(tmp_path / "study", tmp_path / "report")
    runs = {Path(x["path"]).name: x for x in study["smollm2.gguf"]["needles"]}
    pair = runs["claim-S15-T1024-whole"]["pairs"]["ridge+probe [whole] - ridge+probe"]["accuracy"]
    assert pair["n"] == 3 and pair["mean"] == pytest.approx(1 / 3)
    assert not any("[" in k for k in runs["claim-S15-T1024"]["pairs"])
    assert not any("[" in k for k in runs["claim-S15-T10240"]["pairs"])
    md = (tmp_path / "report" / "study.md").read_text()
    assert "| 15 | 1024 | ridge+probe [whole] - ridge+probe | needles | 3 samples | retrieval +33.3 [" in md
    nll_runs = {Path(x["path"]).name: x for x in study["smollm2.gguf"]["nll"]}
    key = nll_runs["nll-S15-T1024-whole"]["pairs"]["ridge+probe [whole] - ridge+probe"]["key"]
    assert key["n"] == 3 and key["mean"] == pytest.approx(-0.4)
    assert not any("[" in k for k in nll_runs["nll-S15-T1024"]["pairs"])


def test_eval_needles_summary_only_summarizes_a_cut_sharded_run_from_its_files_without_loading_the_model(
        tmp_path, monkeypatch):
    from ridgefill_gguf import libs
    from ridgefill_gguf.eval.needles import NeedleOptions, Sample, run_needles

    model, maps = _tiny_model_and_maps(tmp_path)  # the maps give the split (1)
    monkeypatch.setattr(libs, "use_build", lambda *a, **k: pytest.fail("--summary-only loaded a build"))
    out = tmp_path / "cut"
    out.mkdir()
    samples = [Sample(f"single-700-{i}", "single", 700, 690, ["1"], [[10, 12]], "x") for i in range(4)]

    def write_samples(name: str, chosen: list[Sample]) -> None:
        (out / name).write_text("".join(json.dumps(dataclasses.asdict(s)) + "\n" for s in chosen))

    # the final pass listed sample 0 before the deadline; shard 1 of 2 listed samples 1 and 3
    write_samples("samples.jsonl", samples[:1])
    write_samples("samples.shard-1-of-2.jsonl", samples[1::2])
    # the deadline cut the run: sample 2 has only its exact answer; sample 3 lies beyond --samples 3
    answers = [{"sample": f"single-700-{i}", "config": c, "arm": a, "score": float(a == "exact" or i == 0),
                "pred": "", "stats": {}} for i in range(4) for c, a in (("exact", "exact"), ("S1-T128", "ridge"))
               if not (i == 2 and a == "ridge")]
    (out / "results.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
    opts = NeedleOptions(tasks=("single",), lengths=(700,), samples=3, tails=(128,), arms=("ridge",),
                         summary_only=True)
    r = run_needles(model, [maps], out, opts, log=lambda _: None)
    row = r["configs"]["S1-T128"]["groups"]["all tasks"]
    assert row["samples"] == 2 and row["filled_samples"] == 2
    assert row["arms"]["ridge"]["accuracy_filled"] == 0.5 and row["arms"]["exact"]["accuracy_filled"] == 1.0
    assert r["hardware"] is None and "answered nothing" in r["summary_pass"]["note"]
    assert json.loads((out / "summary.json").read_text())["configs"]["S1-T128"]["groups"]["all tasks"]["samples"] == 2
    assert (out / "summary.md").exists()
    for f in out.glob("samples*.jsonl"):
        f.unlink()
    with pytest.raises(ValueError, match="samples.jsonl is missing"):
        run_needles(model, [maps], out, opts, log=lambda _: None)


def test_a_summary_only_pass_without_a_budget_keeps_the_one_its_folder_recorded_and_loads_no_model(
        tmp_path, monkeypatch):
    from ridgefill_gguf import cli, libs

    monkeypatch.setattr(libs, "use_build", lambda *a, **k: pytest.fail("--summary-only loaded a build"))
    (tmp_path / "summary.json").write_text(json.dumps({"selectors": {"budget": 2.0}}))
    no_model = tmp_path / "no-model.gguf"

    def budget(given, folder):
        return cli._selectors(no_model, 0.1, given, True, None, 256, 64, summary_of=folder).budget

    assert budget(None, tmp_path) == 2.0
    assert budget(None, tmp_path / "no-summary-yet") == 1.5  # a label only: no answer depends on it
    assert budget(3.0, tmp_path) == 3.0
