"""On CUDA, every layer on the GPU, a random qwen35 hybrid: resident and streamed maps give the same bytes, plumb and
oracle reproduce stock within the exact-vs-exact noise floor, the filled arm stays near the NumPy specification of
the hybrid arm, and the probe keeps the rows NumPy ranks highest."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_bytes_differ, assert_same_bytes, require_cuda_builds
from test_engine_hybrid import SPLIT, TAIL, base, hybrid, numpy_ranked, rel, slow_decay_hybrid  # noqa: F401
from test_engine_prefill import kl, run_engine
from ridgefill_gguf.reference_hybrid_ridgefill import hybrid_probe_scores, hybrid_ridgefill_forward, stock_forward

pytestmark = pytest.mark.gpu

GPU = {"n_gpu_layers": -1, "flash_attn": True, "n_batch": 64, "n_ubatch": 32, "f32_cache": True}


@pytest.fixture(scope="module")
def wide_hybrid(tmp_path_factory):
    """The slow-decay hybrid with 128-wide DeltaNet heads, the width CUDA's blocked state update takes, and 300
    tokens, so the carry's graphs hold several 64-row blocks and a partial one."""
    return slow_decay_hybrid(tmp_path_factory.mktemp("wide-hybrid"), "qwen35", seed=5, tokens_seed=1, n_tokens=300,
                             ssm_d_state=128)


def test_resident_and_streamed_maps_give_byte_identical_logits_on_a_hybrid_on_cuda(hybrid, tmp_path):
    require_cuda_builds("ridgefill")
    model, maps, _, _, tokens = hybrid
    runs = [{"name": "ridge", "params": base()}, {"name": "probe", "params": base(probe=[8, 10])}]
    out = {p: run_engine(model, maps, runs, session={**GPU, "placement": p}, tokens=tokens, tmp_path=tmp_path)[0]
           for p in ("resident", "streamed")}
    for run in runs:
        assert_same_bytes(out["resident"][run["name"]], out["streamed"][run["name"]], run["name"])


def test_plumb_and_oracle_on_a_hybrid_stay_within_the_noise_floor_on_cuda(hybrid, tmp_path):
    require_cuda_builds("ridgefill")
    model, maps, _, _, tokens = hybrid
    runs = [{"name": "stock", "stock": True}, {"name": "plumb", "params": base(fill="plumb")},
            {"name": "oracle", "params": base(fill="oracle")}]
    arrays, stats = run_engine(model, maps, runs, session=GPU, tokens=tokens, tmp_path=tmp_path)
    other, _ = run_engine(model, maps, runs[:1], session={**GPU, "n_ubatch": 16}, tokens=tokens, tmp_path=tmp_path)
    floor = kl(arrays["stock"], other["stock"])
    for name in ("plumb", "oracle"):
        d = kl(arrays["stock"], arrays[name])
        print(f"{name}: KL {d:.3g} (floor {floor:.3g})")
        assert stats[name]["applied"] == 1 and arrays[name].argmax() == arrays["stock"].argmax()
        assert d <= max(10 * floor, 1e-5), (name, d, floor)


def test_the_filled_arm_and_the_probe_on_a_hybrid_follow_numpy_on_cuda(hybrid, tmp_path):
    require_cuda_builds("ridgefill")
    model, maps, mats, ref, tokens = hybrid
    runs = [{"name": "stock", "stock": True, "rows": TAIL}, {"name": "ridge", "rows": TAIL, "params": base()},
            {"name": "probe", "params": base(probe=[8, 10])}]
    arrays, stats = run_engine(model, maps, runs, session=GPU, tokens=tokens, tmp_path=tmp_path)
    # the floor: CUDA's stock prefill against NumPy's (flash attention in F16, CUDA's kernels)
    floor = rel(arrays["stock"], stock_forward(ref, tokens)[0][-TAIL:])
    err = rel(arrays["ridge"], hybrid_ridgefill_forward(ref, tokens, SPLIT, TAIL, "ridge", mats)[0])
    print(f"ridge on CUDA against NumPy: rel {err:.2e} (stock on CUDA against NumPy: {floor:.2e})")
    assert err < max(3 * floor, 1e-4)
    scores = hybrid_probe_scores(ref, tokens[:-1], SPLIT, TAIL - 1, 8, mats)
    ranked = sorted(sorted(range(1, len(tokens) - TAIL), key=lambda r: (-scores[r], r))[:10])
    got = [r for r in stats["probe"]["exact_rows"] if r != 0]
    print(f"probe on CUDA {got}, NumPy {ranked}")
    assert len(set(got) & set(ranked)) >= 9  # a near-tie may swap at the edge under CUDA's rounding
    assert np.isfinite(arrays["probe"]).all()


def test_the_carrys_chunk_moves_a_hybrids_logits_no_more_than_stocks_own_ubatch_size_does_on_cuda(hybrid, tmp_path):
    require_cuda_builds("ridgefill")
    model, maps, _, _, tokens = hybrid
    chunks = (1, 7, 100)
    runs = [{"name": f"{arm}|{rc}", "params": {**base(**kw), "recurrent_chunk": rc}}
            for arm, kw in {"ridge": {}, "probe": {"probe": [8, 10]}}.items() for rc in (0, *chunks)]
    arrays, _ = run_engine(model, maps, runs, session=GPU, tokens=tokens, tmp_path=tmp_path)
    # CUDA picks other kernels for other row counts (a 1-row product is a vector kernel): stock's own logits move
    # as much when its ubatch changes, so that is the floor
    stock = {u: run_engine(model, maps, [{"name": "stock", "stock": True}], session={**GPU, "n_ubatch": u},
                           tokens=tokens, tmp_path=tmp_path)[0]["stock"] for u in (GPU["n_ubatch"], 1, 7)}
    floor = max(rel(stock[u], stock[GPU["n_ubatch"]]) for u in (1, 7))
    for arm in ("ridge", "probe"):
        for rc in chunks:
            d = rel(arrays[f"{arm}|{rc}"], arrays[f"{arm}|0"])
            print(f"{arm}, carry in {rc}-row graphs: rel {d:.2e} (stock's ubatch 1 and 7: {floor:.2e})")
            assert d <= max(floor, 1e-4), (arm, rc, d, floor)


def test_the_blocked_state_update_follows_numpy_and_the_row_walk_to_float_rounding_on_cuda(wide_hybrid, tmp_path):
    # the default asks the fused op for its blocked form; on 128-wide heads CUDA takes it (other bytes than the row
    # walk's), and it must stay as near NumPy as the row walk does
    require_cuda_builds("ridgefill")
    model, maps, mats, ref, tokens = wide_hybrid
    exact_rows, n_probe, count = [5, 17, 40, 150, 151], 8, 10
    arms = {"ridge": {}, "rows": {"exact_rows": exact_rows}, "probe_rows": {"probe": [n_probe, count]}}
    runs = [{"name": "stock", "stock": True, "rows": TAIL}, {"name": "default", "rows": TAIL, "params": base(4096)}]
    runs += [{"name": f"{arm}|{update}", "rows": TAIL, "params": {**base(4096, **kw), "state_update": update}}
             for arm, kw in arms.items() for update in ("fused", "blocked")]
    arrays, stats = run_engine(model, maps, runs, session=GPU, tokens=tokens, tmp_path=tmp_path)
    floor = rel(arrays["stock"], stock_forward(ref, tokens)[0][-TAIL:])
    ranked = numpy_ranked(ref, tokens, TAIL, mats, n_probe, count)
    arm = lambda **kw: hybrid_ridgefill_forward(ref, tokens, SPLIT, TAIL, "ridge", mats, **kw)[0]  # noqa: E731
    want = {"ridge": arm(), "rows": arm(exact_rows=exact_rows), "probe_rows": arm(exact_rows=ranked)}
    for name, expected in want.items():
        fused, blocked = arrays[f"{name}|fused"], arrays[f"{name}|blocked"]
        err_f, err_b, moved = rel(fused, expected), rel(blocked, expected), rel(blocked, fused)
        print(f"{name}: blocked rel {err_b:.2e} against NumPy, row walk {err_f:.2e}, moved {moved:.2e} "
              f"(stock on CUDA against NumPy: {floor:.2e})")
        assert stats[f"{name}|blocked"]["n_filled"] > 200
        assert_bytes_differ(blocked, fused, name)  # the blocked kernel ran
        assert err_b < max(3 * floor, 1e-4) and moved < max(3 * floor, 1e-4), (name, err_b, moved, floor)
    assert_same_bytes(arrays["default"], arrays["ridge|blocked"])


def test_a_carry_graph_that_reads_only_the_states_leaves_the_outputs_unwritten_without_moving_a_byte_on_cuda(
        wide_hybrid, tmp_path):
    # in 128-row carry graphs, rows 128-255 are all filled, so their graphs read only the states and the blocked
    # update skips the outputs: filling those with NaN, or writing them, must give the same bytes (no graph reads
    # what was skipped, and the states are the same)
    require_cuda_builds("ridgefill")
    model, maps, _, _, tokens = wide_hybrid
    runs = [{"name": "ridge", "rows": TAIL, "params": {**base(4096), "recurrent_chunk": 128}},
            {"name": "probe", "rows": TAIL, "params": {**base(4096, probe=[8, 10]), "recurrent_chunk": 128}}]
    out = {}
    for unread in ("", "nan", "write"):
        (tmp_path / (unread or "skip")).mkdir()
        out[unread], stats = run_engine(model, maps, runs, session=GPU, tokens=tokens,
                                        tmp_path=tmp_path / (unread or "skip"),
                                        env={"GGML_CUDA_RIDGEFILL_GDN_UNREAD_OUTPUTS": unread})
        assert stats["ridge"]["n_filled"] > 200
    for run in runs:
        assert np.isfinite(out["nan"][run["name"]]).all(), run["name"]
        assert_same_bytes(out["nan"][run["name"]], out[""][run["name"]], run["name"])
        assert_same_bytes(out["write"][run["name"]], out[""][run["name"]], run["name"])
