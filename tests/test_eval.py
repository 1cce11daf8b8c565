"""The quality instruments: bootstrap, token masks, the scorer, and `eval nll` end to end on a tiny model."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conftest import require_builds
from ridgefill_gguf.eval.stats import bootstrap_mean
from ridgefill_gguf.eval.tokens import key_mask, novel_mask, token_nll


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


def test_eval_nll_scores_documents_resumes_and_plumb_costs_nothing(tmp_path):
    require_builds("ridgefill")
    from ridgefill_gguf.eval.nll import NllOptions, run_nll
    from ridgefill_gguf.maps.synthetic import write_random_maps
    from ridgefill_gguf.random_gguf import tiny_shape, write_random_model

    model = write_random_model(tmp_path / "m.gguf", dataclasses.replace(tiny_shape("qwen3"), n_layer=4), seed=9)
    maps = write_random_maps(model, 1, tmp_path / "maps.gguf")
    docs = tmp_path / "docs"
    docs.mkdir()
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
    rng = np.random.default_rng(1)
    for i in range(3):
        (docs / f"d{i}.txt").write_text(" ".join(rng.choice(words, size=500)) + "\n")
    (docs / "short.txt").write_text("too short\n")
    opts = NllOptions(arms=("plumb", "ridge", "none"), tail=128, score=64, min_tokens=300, max_tokens=600,
                      threads=2, flash_attn=False)
    logs = []
    r = run_nll(model, maps, [docs], tmp_path / "out", opts, log=logs.append)
    assert r["documents"] == 3 and any("skip short.txt" in line for line in logs)
    rows = [json.loads(x) for x in (tmp_path / "out" / "documents.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(row["counts"]["all"] == 64 for row in rows)
    # plumb runs every row exactly through the RidgeFill path: no loss
    assert abs(r["summary"]["plumb"]["all"]["mean"]) < 1e-4
    assert r["summary"]["ridge"]["all"]["n"] == 3
    assert all(f"| d{i}.txt | " in (tmp_path / "out" / "summary.md").read_text() for i in range(3))
    assert (tmp_path / "out" / "summary.png").exists()
    # a second run finds everything done
    logs.clear()
    run_nll(model, maps, [docs], tmp_path / "out", opts, log=logs.append)
    assert any("resuming, 3 documents done" in line for line in logs)
    assert not any(line.startswith("eval nll: document") for line in logs)
