"""eval facts: facts in real text asked in other words, and a follow-up over the reused cache."""
from __future__ import annotations

import json
import random
import shutil
import textwrap
from dataclasses import replace
from pathlib import Path

from conftest import require_builds, tiny_qwen3_with_random_maps
from ridgefill_gguf.eval import facts as F
from ridgefill_gguf.eval.report import run_report


def test_every_question_shares_no_run_of_four_words_with_any_fact_of_its_prompt():
    for seed in range(500):
        for domain in F.DOMAINS:
            facts = F.choose_facts(domain, random.Random(seed))
            assert len({f.answer for f in facts}) == 4
            assert facts[0].domain == domain  # the document's own domain first
            for q in facts:
                assert not any(F.shares_run(q.question, f.text) for f in facts), (q, facts)


def test_shares_run_finds_a_run_of_four_words_across_case_and_punctuation():
    assert F.shares_run("Where is the stone bridge at Old Wick?", "THE STONE BRIDGE, at dusk")
    assert not F.shares_run("the stone bridge fell", "the stone wall of the bridge")


def test_a_fact_is_answered_when_its_digits_appear_in_the_prediction():
    assert F.answered(" It cost 1,742 dollars.", "1742") == 1.0
    assert F.answered(" 174 dollars", "1742") == 0.0


def model_maps_and_code_docs(tmp_path):
    """A tiny qwen3 with random maps, and one standard-library module as the documents."""
    require_builds("ridgefill")
    (tmp_path / "docs" / "code").mkdir(parents=True)
    (tmp_path / "docs" / "code" / "textwrap.py.txt").write_text(Path(textwrap.__file__).read_text())
    return tiny_qwen3_with_random_maps(tmp_path)


def test_eval_facts_asks_both_questions_over_the_reused_cache_and_plumb_answers_as_exact(tmp_path):
    model, maps = model_maps_and_code_docs(tmp_path)
    opts = F.FactOptions(docs=(str(tmp_path / "docs"),), lengths=(900,), samples=2, tails=(128,),
                         arms=("plumb", "ridge", "ridge+probe", "ridge+random:probe"), fmt="completion", threads=2,
                         flash_attn=False)
    r = F.run_facts(model, [maps], tmp_path / "out", opts, log=lambda _: None)
    samples = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    answers = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and len(answers) == 2 * 5
    by = {(a["sample"], a["arm"]): a for a in answers}
    for s in samples:
        assert s["domain"] == "code" and abs(s["n_tokens"] - 900) < 60, s
        exact, plumb = by[(s["sample_id"], "exact")], by[(s["sample_id"], "plumb")]
        assert (plumb["pred"], plumb["pred_follow_up"]) == (exact["pred"], exact["pred_follow_up"])
        for arm in ("ridge", "ridge+probe"):
            a = by[(s["sample_id"], arm)]
            assert a["stats"]["applied"] == 1 and a["stats"]["n_filled"] > 0
            # the follow-up reuses the first prefill's cells: every fact's rows are in the common prefix
            assert a["reused"] >= max(f["rows"][1] for f in s["facts"]), (a["reused"], s["facts"])
            for f, m in zip(s["facts"], a["mechanisms"]):
                assert sum(m.values()) == f["rows"][1] - f["rows"][0]
                assert m["lexical"] == 0  # no question repeats four words of a fact
        assert sum(by[(s["sample_id"], "ridge")]["mechanisms"][s["asked"]][k] for k in ("lexical", "selected")) == 0
    t = r["configs"]["S1-T128"]["turns"]
    assert set(t) == {"first", "follow_up"} and t["first"]["arms"]["plumb"]["delta"]["mean"] in (0.0, None)
    assert (tmp_path / "out" / "summary.png").exists()
    assert "| S1-T128 | follow_up |" in (tmp_path / "out" / "summary.md").read_text()


def test_the_exact_only_follow_up_prefills_the_conversation_again_and_a_resumed_run_adds_it(tmp_path):
    model, maps = model_maps_and_code_docs(tmp_path)
    opts = F.FactOptions(docs=(str(tmp_path / "docs"),), lengths=(900,), samples=1, tails=(128,),
                         arms=("plumb", "ridge+probe", "ridge+random:probe"), fmt="completion", threads=2,
                         flash_attn=False)
    first = F.run_facts(model, [maps], tmp_path / "out", opts, log=lambda _: None)
    assert set(first["configs"]["S1-T128"]["turns"]) == {"first", "follow_up"}
    opts.exact_only_follow_up = True
    r = F.run_facts(model, [maps], tmp_path / "out", opts, log=lambda _: None)
    answers = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    by = {a["arm"]: a for a in answers}  # the resumed run's rows come last
    assert len(answers) == 8 and all("score_follow_up_exact_only" in by[a] for a in ("exact", "plumb", "ridge+probe"))
    exact, plumb, probe = by["exact"], by["plumb"], by["ridge+probe"]
    assert exact["pred_follow_up_exact_only"] == exact["pred_follow_up"]  # a stock cache is exact: all of it stays
    assert plumb["pred_follow_up_exact_only"] == exact["pred_follow_up"]
    # the whole conversation was prefilled again, not only the rows after the first answer
    assert probe["stats_exact_only"]["applied"] == 1
    again = probe["stats_exact_only"]
    assert again["n_filled"] + again["n_exact"] + again["n_tail"] > probe["reused"] > probe["stats"]["n_tail"]
    assert again["n_probe_exact"] > 0  # the probe ranked the conversation's rows for the new question
    # the random control in that prefill is count-matched to its probe (on this tiny prompt the first prefill's probe
    # chose as many rows, so this does not tell the two counts apart)
    rand = by["ridge+random:probe"]
    assert rand["stats_exact_only"]["n_exact"] == again["n_exact"] and rand["stats_exact_only"]["n_probe_exact"] == 0
    assert set(r["configs"]["S1-T128"]["turns"]) == {"first", "follow_up", "follow_up_exact_only"}
    assert "| S1-T128 | follow_up_exact_only |" in (tmp_path / "out" / "summary.md").read_text()
    # asked in one run, the exact-only prefill resumes from the first prefill's split state, as the server's does,
    # and answers as in the run above (whose prefills took theirs from the arm before, or ran every row)
    F.run_facts(model, [maps], tmp_path / "one-run", opts, log=lambda _: None)
    one = {a["arm"]: a for a in map(json.loads, (tmp_path / "one-run" / "results.jsonl").read_text().splitlines())}
    assert one["ridge+probe"]["stats_exact_only"]["held"] > 0
    for arm in ("ridge+probe", "ridge+random:probe"):
        assert one[arm]["pred_follow_up_exact_only"] == by[arm]["pred_follow_up_exact_only"], arm


def test_facts_shards_answer_their_own_samples_and_a_whole_run_after_them_only_summarizes(tmp_path):
    model, maps = model_maps_and_code_docs(tmp_path)
    opts = F.FactOptions(docs=(str(tmp_path / "docs"),), lengths=(600,), samples=3, tails=(128,), arms=("ridge",),
                         fmt="completion", threads=2, flash_attn=False)
    out = tmp_path / "out"
    for i in range(2):
        F.run_facts(model, [maps], out, replace(opts, shard=(i, 2)), log=lambda _: None)
    assert not (out / "summary.json").exists()
    answers = (out / "results.jsonl").read_text().splitlines()
    assert sorted({json.loads(a)["sample"] for a in answers}) == [f"code-600-{i}" for i in range(3)]
    r = F.run_facts(model, [maps], out, opts, log=lambda _: None)
    assert (out / "results.jsonl").read_text().splitlines() == answers  # nothing asked again
    assert r["n_samples"] == 3 and (out / "summary.md").exists()
    # a later version summarizes the folder again without the model, keeping the machine the answers came from
    made_there = {**json.loads((out / "summary.json").read_text()), "hardware": {"gpu": "where they were made"}}
    (out / "summary.json").write_text(json.dumps(made_there))
    again = F.run_facts(tmp_path / "no-model.gguf", [maps], out, replace(opts, summary_only=True),
                        log=lambda _: None)
    assert again["configs"] == r["configs"] and again["hardware"] == {"gpu": "where they were made"}
    assert "answered nothing" in again["summary_pass"]["note"]
    assert (out / "results.jsonl").read_text().splitlines() == answers
    # eval report tests each question's arms against exact, beside the needles; a tagged run (another setting,
    # its own exact arm) is tested within itself
    shutil.copytree(out, tmp_path / "out-budget2")
    runs, tagged = run_report(tmp_path, tmp_path / "report")[model.name]["facts"]
    assert tagged["path"].endswith("out-budget2") and tagged["turns"] == runs["turns"]
    assert set(runs["turns"]) <= {"first", "follow_up"} and runs["split"] == 1
    samples = [F.FactSample(**json.loads(x)) for x in (out / "samples.jsonl").read_text().splitlines()]
    before_tail = sum(s.filled_region(128, s.asked) for s in samples)
    assert runs["turns"]["first"]["ridge"]["n"] == before_tail > 0
    assert "Facts asked in other words" in (tmp_path / "report" / "study.md").read_text()


def test_a_document_whose_token_rate_jumps_still_makes_a_prompt_of_about_the_asked_length():
    # a fake tokenizer: four letters a token, every digit a token; prose first, then a long table of numbers
    def tokenize(text: str) -> list[int]:
        digits = sum(c.isdigit() for c in text)
        return [0] * (digits + (len(text) - digits) // 4)

    prose = "The committee met again in the spring and read the reports aloud.\n\n" * 300
    table = "".join(f"{i:06d} {i * 7 % 999983:06d}\n" for i in range(40000))
    builder = F.FactPromptBuilder(tokenize, None)
    for length in (3072, 8192):
        sample, tokens, _ = builder.build("table.txt", "legal", prose + table, length, 0, 0)
        assert 0.97 * length <= len(tokens) <= 1.02 * length, (length, len(tokens))


def test_a_summary_splits_the_answers_that_differ_from_exact_by_whether_the_asked_fact_was_filled():
    facts = [{"rows": [10, 20], "answer": "1"}, {"rows": [30, 40], "answer": "2"}]
    samples = [F.FactSample(f"code-4096-{i}", "doc", "code", 100, facts, 0, 1, "x") for i in range(5)]
    counts = {"filled": dict.fromkeys(F.MECHANISMS, 0) | {"selected": 7, "filled": 3},
              "exact": dict.fromkeys(F.MECHANISMS, 0) | {"selected": 10}}
    # (exact's score, the arm's score, the asked fact's rows) per sample: lost filled, lost exact twice, won exact,
    # and one agreeing sample that counts in neither
    cases = [(1, 0, "filled"), (1, 0, "exact"), (1, 0, "exact"), (0, 1, "exact"), (1, 1, "filled")]
    answers = []
    for s, (e, a, rows) in zip(samples, cases):
        answers.append({"sample": s.sample_id, "config": "exact", "arm": "exact", "score": e, "score_follow_up": 0})
        answers.append({"sample": s.sample_id, "config": "S12-T50", "arm": "ridge+probe", "score": a,
                        "score_follow_up": 0, "mechanisms": [counts[rows], counts["exact"]]})
    r = F.summarize(samples, answers, {"maps": 12}, F.FactOptions(tails=(50,), arms=("ridge+probe",)))
    first = r["configs"]["S12-T50"]["turns"]["first"]["arms"]["ridge+probe"]
    assert first["discordant"] == {"lost_filled": 1, "lost_exact": 2, "won_filled": 0, "won_exact": 1}
    assert first["fact_rows"]["filled"] == 6 and first["samples"] == 5
    assert r["configs"]["S12-T50"]["turns"]["follow_up"]["arms"]["ridge+probe"]["discordant"] == dict.fromkeys(
        F.DISCORDANT, 0)
    assert "| 1+2 / 0+1 |" in F.markdown({**r, "options": {"lengths": [100], "seed": 0, "arms": ["ridge+probe"]},
                                          "model": "m.gguf", "format": "chat"})


def test_an_arm_run_on_fewer_prompts_is_shown_beside_exacts_accuracy_on_those_prompts():
    facts = [{"rows": [10, 20], "answer": "1"}, {"rows": [30, 40], "answer": "2"}]
    samples = [F.FactSample(f"code-4096-{i}", "doc", "code", 100, facts, 0, 1, "x") for i in range(4)]
    answers = [{"sample": s.sample_id, "config": "exact", "arm": "exact", "score": e, "score_follow_up": 0}
               for s, e in zip(samples, (1, 1, 0, 0))]
    answers += [{"sample": s.sample_id, "config": "S12-T50", "arm": "ridge+probe", "score": a, "score_follow_up": 0}
                for s, a in zip(samples[:2], (1, 0))]
    r = F.summarize(samples, answers, {"maps": 12}, F.FactOptions(tails=(50,), arms=("ridge+probe",)))
    first = r["configs"]["S12-T50"]["turns"]["first"]
    assert first["arms"]["exact"]["accuracy"] == 0.5 and first["arms"]["ridge+probe"]["exact_accuracy"] == 1.0
    md = F.markdown({**r, "options": {"lengths": [100], "seed": 0, "arms": ["ridge+probe"]}, "model": "m.gguf",
                     "format": "chat"})
    assert "| S12-T50 | first | 2 | 100 | ridge+probe | 50 | -50 " in md


def test_the_reranked_follow_up_keeps_the_first_prefills_exact_rows_and_ranks_the_rest_for_the_new_question(
        tmp_path):
    model, maps = model_maps_and_code_docs(tmp_path)
    opts = F.FactOptions(docs=(str(tmp_path / "docs"),), lengths=(900,), samples=1, tails=(128,),
                         arms=("ridge+probe", "ridge+random:probe"), fmt="completion", threads=2, flash_attn=False)
    F.run_facts(model, [maps], tmp_path / "out", opts, log=lambda _: None)
    r = F.run_facts(model, [maps], tmp_path / "out", replace(opts, rerank_follow_up=True), log=lambda _: None)
    by = {a["arm"]: a for a in map(json.loads, (tmp_path / "out" / "results.jsonl").read_text().splitlines())}
    sample = F.FactSample(**json.loads((tmp_path / "out" / "samples.jsonl").read_text()))
    exact, probe = by["exact"], by["ridge+probe"]
    assert exact["pred_follow_up_rerank"] == exact["pred_follow_up"]  # a stock cache is exact
    assert "exact_ranges" not in probe  # added to a run made without the option: its first prefill ran again
    first, again = probe["stats"], probe["stats_rerank"]
    # the rows it lists are those the first prefill ran exactly: its exact prefix rows and its tail
    assert probe["kept_exact"] == first["n_exact"] + first["n_tail"] and again["n_probe_exact"] > 0
    # of them, those in the follow-up's prefix stay exact beside the rows the probe ranks for the new question
    prefix1, prefix2 = sample.n_tokens - first["n_tail"], again["n_filled"] + again["n_exact"]
    kept_in_prefix = first["n_exact"] + max(0, min(sample.n_tokens, prefix2) - prefix1)
    assert again["n_exact"] >= kept_in_prefix + again["n_probe_exact"]
    for fact, before, after in zip(sample.facts, probe["mechanisms"], probe["mechanisms_rerank"]):
        assert after["filled"] <= before["filled"], (fact, before, after)  # what was exact stays exact
    assert set(r["configs"]["S1-T128"]["turns"]) == {"first", "follow_up", "follow_up_rerank"}
    # asked in one run, the first prefill's rows come from its record, with the same answers
    one = F.run_facts(model, [maps], tmp_path / "one", replace(opts, rerank_follow_up=True), log=lambda _: None)
    # (each arm's prefills list no rows another arm's re-ranked follow-up listed)
    assert one["configs"] == r["configs"]
    rows = {a["arm"]: a for a in map(json.loads, (tmp_path / "one" / "results.jsonl").read_text().splitlines())}
    assert F.rows_of(rows["ridge+probe"]["exact_ranges"]) and rows["ridge+probe"]["kept_exact"] == probe["kept_exact"]
    # the random control lists its own first prefill's rows either way, run again with that prefill's count
    rand = "ridge+random:probe"
    assert rows[rand]["kept_exact"] == by[rand]["kept_exact"] == by[rand]["stats"]["n_exact"] + by[rand]["stats"]["n_tail"]
    assert rows[rand]["mechanisms_rerank"] == by[rand]["mechanisms_rerank"]


def test_exact_rows_travel_as_runs_and_come_back_whole():
    rows = [0, 1, 2, 5, 7, 8, 20]
    assert F.ranges_of(rows) == [[0, 3], [5, 6], [7, 9], [20, 21]] and F.rows_of(F.ranges_of(rows)) == rows
    assert F.ranges_of([]) == [] and F.rows_of([]) == []
