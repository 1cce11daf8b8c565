"""A RidgeFill prefill again over rows the last one put in the cache (the exact-only follow-up: the same document, a
new question) takes their split state from that prefill's sweep one (llama_ridgefill_held_rows / _prefill_resume):
it gives the bytes of a fresh RidgeFill prefill of the whole conversation, on a hybrid too (with the states its rows
left below the split put back), and it takes no row it should not."""
from __future__ import annotations

import pytest

from conftest import require_builds
from ridgefill_gguf.maps.synthetic import tiny_model_with_maps
from test_engine_steps import run_script

# the default selector's kind (the probe with its budget, which scores the last rows' lower-layer attention too)
PARAMS = {"tail": 40, "fill": "ridge", "chunk": 48, "min_prefix": 0, "probe_budget": [16, 1.0]}

# the first prompt, then a follow-up resumed over it, against a fresh prefill of the follow-up
COMMON = r'''
import json, sys
import numpy as np
from ridgefill_gguf.engine.session import Session
from ridgefill_gguf.engine import bindings as B

cfg = json.loads(sys.argv[1])
S = Session(cfg["model"], n_ctx=1024, n_batch=64, n_ubatch=32, n_threads=2, maps=cfg["maps"])
rng = np.random.default_rng(0)
# the first prompt's rows before its last token fill whole batches, so that the follow-up's sweep one runs the
# batches a fresh prefill of the conversation runs
first = [int(t) for t in rng.integers(1000, 5000, 257)]
follow = first + [int(t) for t in rng.integers(1000, 5000, 120)]
p = cfg["params"]
res = {}

fresh, _, st_fresh = S.ridgefill(follow, **p)
S.ridgefill(first, **p)
res["held_after_first"] = B.held_rows(S.ctx, follow[:-1], 0)
res["held_from_100"] = B.held_rows(S.ctx, follow[100:-1], 100)
changed = list(follow[:-1]); changed[200] += 1
res["held_with_a_changed_token"] = B.held_rows(S.ctx, changed, 0)
res["held_for_a_short_question"] = B.held_rows(S.ctx, first[:-1] + first[:20], 0)
resumed, _, st = S.ridgefill_resumed(follow, **p)
res["held"], res["applied"] = st["held"], st["applied"]
res["exact_rows_equal"] = st["exact_rows"] == st_fresh["exact_rows"]
res["identical"] = resumed.tobytes() == fresh.tobytes()
res["max_diff"] = float(np.abs(resumed - fresh).max())
'''

SCRIPT = COMMON + r'''# the resumed prefill's own sweep one is held now; a prefill of another prompt in between leaves none
res["held_after_resumed"] = B.held_rows(S.ctx, follow[:-1], 0)
S.ridgefill([7] * 300, **p)
res["held_after_another_prompt"] = B.held_rows(S.ctx, follow[:-1], 0)

mem = S.lc.llama_get_memory(S.ctx)
def last(pos0, tokens):
    S._decode(tokens[-1:], pos0 + len(tokens) - 1, "last")
    return S._last_logits()

# resumed from a row after the first: the held rows move to x_split's first rows; against a fresh RidgeFill
# prefill from there over the same cells before it
S.ridgefill(first, **p)
S.lc.llama_memory_seq_rm(mem, 0, 128, -1)
B.prefill(S.ctx, follow[128:-1], n_following=1)
fresh_128 = last(128, follow[128:])
S.ridgefill(first, **p)
n = B.held_rows(S.ctx, follow[128:-1], 128)
S.lc.llama_memory_seq_rm(mem, 0, 128 + n, -1)
res["held_from_128"], res["applied_from_128"] = n, B.prefill_resumed(S.ctx, follow[128:-1], n, n_following=1)
res["identical_from_128"] = last(128, follow[128:]).tobytes() == fresh_128.tobytes()

# a removed row ends the held rows; a state load forgets them
S.ridgefill(first, **p)
S.lc.llama_memory_seq_rm(mem, 0, 50, 51)
res["held_after_a_removed_row"] = B.held_rows(S.ctx, follow[:-1], 0)
S.ridgefill(first, **p)
B.forget_held(S.ctx)
res["held_after_forget"] = B.held_rows(S.ctx, follow[:-1], 0)

# asked to resume more rows than are held (the first prompt's last token, decoded stock, has no split state held),
# it does not begin and removes the rows from the first one it was to resume
S.ridgefill(first, **p)
res["more_than_held"] = B.prefill_resumed(S.ctx, follow[:-1], len(first), n_following=1)
res["pos_max_after"] = S.lc.llama_memory_seq_pos_max(mem, 0)
print("RESULT " + json.dumps(res))
'''


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """SCRIPT's answers on a 4-layer llama with maps at split 1."""
    require_builds("ridgefill")
    model, maps = tiny_model_with_maps(tmp_path_factory.mktemp("engine-resume"), "llama", n_layer=4, split=1)
    return run_script(SCRIPT, {"model": str(model), "maps": str(maps), "params": PARAMS})


def test_a_follow_up_resumed_from_the_held_split_state_gives_the_bytes_of_a_fresh_ridgefill_prefill(resumed):
    res = resumed
    assert res["held_after_first"] == 256          # the first prefill's rows (its last token was decoded stock)
    assert res["held"] == 256 and res["applied"] == 1
    assert res["exact_rows_equal"]
    assert res["identical"], res["max_diff"]
    assert res["held_after_resumed"] == 376 - 64   # all but the rows the budget scores in sweep one


def test_only_rows_with_the_same_tokens_cells_and_enough_question_after_them_are_held(resumed):
    res = resumed
    assert res["held_from_100"] == 156             # the held rows from position 100 on
    assert res["held_with_a_changed_token"] == 200  # up to the changed token
    assert res["held_for_a_short_question"] == 276 - 64  # the last 64 rows' attention is scored in sweep one
    assert res["held_after_another_prompt"] == 0
    assert res["held_after_a_removed_row"] == 50
    assert res["held_after_forget"] == 0


def test_a_resume_after_the_first_row_gives_the_bytes_of_a_fresh_prefill_from_there(resumed):
    assert resumed["held_from_128"] == 256 - 128 and resumed["applied_from_128"]
    assert resumed["identical_from_128"]


def test_a_resume_of_more_rows_than_are_held_does_not_begin_and_removes_them(resumed):
    assert resumed["more_than_held"] is False
    assert resumed["pos_max_after"] == -1


HYBRID_SCRIPT = COMMON + r'''# a follow-up that adds fewer rows than the budget scores resumes up to the batch boundary kept before them
short = first + [int(t) for t in rng.integers(1000, 5000, 20)]
fresh_short = S.ridgefill(short, **p)[0]
S.ridgefill(first, **p)
resumed_short, _, st_short = S.ridgefill_resumed(short, **p)
res["short_held"] = st_short["held"]
res["short_identical"] = resumed_short.tobytes() == fresh_short.tobytes()
S.ridgefill(first, **p)
res["keep_refused"] = B.keep_held(S.ctx, 0, 100)  # not where that prefill ended: every row goes
res["pos_max_after_refusal"] = S.lc.llama_memory_seq_pos_max(S.lc.llama_get_memory(S.ctx), 0)
# a follow-up over the reused cache continues the whole cached sequence; a part of it cannot be kept alone
S.ridgefill(first, **p)
res["extended_reused"] = S.extend(first, follow)[1]
try:
    S.extend(follow, first[:100] + [7] * 30)
    res["partial_extend"] = "kept"
except RuntimeError as e:
    res["partial_extend"] = str(e)
print("RESULT " + json.dumps(res))
'''


@pytest.fixture(scope="module")
def hybrid_resumed(tmp_path_factory):
    """HYBRID_SCRIPT's answers on an 8-layer qwen35 with maps at split 2 (DeltaNet layers below and after it)."""
    require_builds("ridgefill")
    model, maps = tiny_model_with_maps(tmp_path_factory.mktemp("engine-resume-hybrid"), "qwen35", n_layer=8, split=2)
    return run_script(HYBRID_SCRIPT, {"model": str(model), "maps": str(maps), "params": PARAMS})


def test_a_hybrid_follow_up_resumed_with_the_lower_states_its_rows_left_gives_the_bytes_of_a_fresh_prefill(
        hybrid_resumed):
    res = hybrid_resumed
    assert res["held_after_first"] == 256 and res["held"] == 256 and res["applied"] == 1
    assert res["exact_rows_equal"]
    assert res["identical"], res["max_diff"]


def test_a_hybrid_holds_rows_only_up_to_where_its_states_were_kept_since_its_state_cannot_go_back_elsewhere(
        hybrid_resumed):
    # kept after all 256 rows of the first prefill, and at its last batch boundary (64 rows) at or before row
    # 256 + 1 - 64, where the shortest follow-up's scored rows begin
    res = hybrid_resumed
    assert res["held_from_100"] == 0
    assert res["held_with_a_changed_token"] == 192    # a change at row 200
    assert res["held_for_a_short_question"] == 192    # 20 rows added: its last 64 rows begin at 212
    assert res["short_held"] == 192 and res["short_identical"]
    assert res["keep_refused"] is False and res["pos_max_after_refusal"] == -1
    assert res["extended_reused"] == 257
    assert "cannot keep its first 100 of 377 positions alone" in res["partial_extend"]


KEEP_SCRIPT = COMMON + r'''# keep_held_exact: the first prefill's exact rows (its chosen prefix rows and its tail) stay exact in the resumed
# one, which is the resumed prefill with those rows listed exact (the research control eval facts lists them with)
_, _, st_first = S.ridgefill(first, **p)
tail0 = len(first) - 1 - st_first["n_tail"]
listed = sorted(set(st_first["exact_rows"]) | set(range(tail0, len(first) - 1)))
kept, _, st_kept = S.ridgefill_resumed(follow, **p, keep_held_exact=True)
S.ridgefill(first, **p)
emulated, _, st_emulated = S.ridgefill_resumed(follow, **p, keep_held_exact=False, exact_rows=listed)
S.ridgefill(first, **p)
plain, _, st_plain = S.ridgefill_resumed(follow, **p, exact_rows=[])  # configure keeps what it was given
res["kept_identical_to_listed"] = kept.tobytes() == emulated.tobytes()
res["kept_rows_equal"] = st_kept["exact_rows"] == st_emulated["exact_rows"]
res["first_exact_kept"] = set(listed) <= set(st_kept["exact_rows"])
res["n_kept_exact"], res["n_exact_kept"], res["n_exact_plain"] = (st_kept["n_kept_exact"], st_kept["n_exact"],
                                                                  st_plain["n_exact"])
res["held_kept"] = st_kept["held"]
# with nothing held (a fresh prefill) the setting keeps nothing and changes no byte
fresh_keep, _, st_fresh_keep = S.ridgefill(follow, **p, keep_held_exact=True, exact_rows=[])
res["fresh_unchanged"] = fresh_keep.tobytes() == fresh.tobytes() and st_fresh_keep["n_kept_exact"] == 0
print("RESULT " + json.dumps(res))
'''


@pytest.mark.parametrize("arch,n_layer,split", [("llama", 4, 1), ("qwen35", 8, 2)])
def test_a_resumed_prefill_that_keeps_the_held_exact_rows_is_the_resume_with_those_rows_listed_exact(
        tmp_path, arch, n_layer, split):
    require_builds("ridgefill")
    model, maps = tiny_model_with_maps(tmp_path, arch, n_layer=n_layer, split=split)
    res = run_script(KEEP_SCRIPT, {"model": str(model), "maps": str(maps), "params": PARAMS})
    assert res["held_kept"] == 256
    assert res["kept_identical_to_listed"] and res["kept_rows_equal"] and res["first_exact_kept"]
    # it keeps rows the new ranking alone would have filled
    assert res["n_kept_exact"] > 0 and res["n_exact_kept"] > res["n_exact_plain"]
    assert res["fresh_unchanged"]
