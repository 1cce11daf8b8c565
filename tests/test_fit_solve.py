"""The ridge solve from running sums: recovers known maps and equals a one-shot solve."""
from __future__ import annotations

import numpy as np
import pytest

from ridgefill_gguf.fit.solve import solve
from ridgefill_gguf.fit.sums import CaptureState, SplitSums


def synthetic(rng, n, d, layers, noise=0.01):
    x = rng.standard_normal((n, d)).astype(np.float32) * 3 + 1.5
    truth = {layer: (rng.standard_normal((d, d)).astype(np.float32) / np.sqrt(d),
                     rng.standard_normal(d).astype(np.float32)) for layer in layers}
    ys = {layer: x @ a.T + b + noise * rng.standard_normal((n, d)).astype(np.float32)
          for layer, (a, b) in truth.items()}
    return x, ys, truth


def test_the_solve_recovers_a_known_linear_map():
    rng = np.random.default_rng(0)
    x, ys, truth = synthetic(rng, 4000, 32, [5, 6])
    ss = SplitSums(4, [5, 6], 32, 32)
    ss.add(x, ys)
    sol = solve(ss, lam=1e-6)
    for layer, (a, b) in truth.items():
        assert np.abs(sol[layer].weight - a).max() < 2e-3
        assert np.abs(sol[layer].bias - b).max() < 5e-3


def test_streamed_sums_equal_a_one_shot_solve_on_all_rows():
    rng = np.random.default_rng(1)
    x, ys, _ = synthetic(rng, 3000, 24, [3])
    one = SplitSums(2, [3], 24, 24)
    one.add(x, ys)
    streamed = SplitSums(2, [3], 24, 24)
    for chunk in np.array_split(np.arange(3000), 7):
        streamed.add(x[chunk], {3: ys[3][chunk]})
    a, b = solve(one, 0.01)[3], solve(streamed, 0.01)[3]
    np.testing.assert_allclose(a.weight, b.weight, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.bias, b.bias, rtol=1e-5, atol=1e-6)
    # and both equal the textbook formula on the stacked, centered rows
    xc, yc = x.astype(np.float64) - x.mean(0), ys[3].astype(np.float64) - ys[3].mean(0)
    alpha = 0.01 * np.trace(xc.T @ xc) / 24
    ref = yc.T @ xc @ np.linalg.inv(xc.T @ xc + alpha * np.eye(24))
    np.testing.assert_allclose(a.weight, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(a.bias, ys[3].mean(0) - ref @ x.mean(0), rtol=1e-4, atol=1e-4)


def test_a_larger_lambda_shrinks_the_map():
    rng = np.random.default_rng(2)
    x, ys, _ = synthetic(rng, 500, 16, [1])
    ss = SplitSums(0, [1], 16, 16)
    ss.add(x, ys)
    norms = [np.linalg.norm(solve(ss, lam)[1].weight) for lam in (1e-4, 1e-2, 1.0)]
    assert norms[0] > norms[1] > norms[2]


def test_saved_sums_load_back_identically_and_solve_the_same(tmp_path):
    rng = np.random.default_rng(3)
    x, ys, _ = synthetic(rng, 800, 16, [2, 3])
    ss = SplitSums(1, [2, 3], 16, 16)
    ss.add(x, ys)
    state = CaptureState("abc", {1: ss}, done_docs=["d1"], tokens=800, excluded_rows={"1": {"position": 2}})
    state.save(tmp_path / "sums.npz")
    back = CaptureState.load(tmp_path / "sums.npz")
    assert back.done_docs == ["d1"] and back.tokens == 800 and back.excluded_rows == {"1": {"position": 2}}
    b = back.splits[1]
    assert b.n == ss.n and np.array_equal(b.xtx, ss.xtx) and np.array_equal(b.xty[3], ss.xty[3])
    assert np.array_equal(solve(b, 0.03)[2].weight, solve(ss, 0.03)[2].weight)
    # a resumed capture keeps adding into the loaded sums
    more_x, more_ys, _ = synthetic(rng, 300, 16, [2, 3])
    b.add(more_x, more_ys)
    ss.add(more_x, more_ys)
    assert b.n == ss.n and np.array_equal(b.xty[2], ss.xty[2]) and np.array_equal(b.sum_y[3], ss.sum_y[3])


def test_too_few_rows_are_refused():
    ss = SplitSums(0, [1], 4, 4)
    ss.add(np.ones((1, 4), np.float32), {1: np.ones((1, 4), np.float32)})
    with pytest.raises(ValueError, match="too few"):
        solve(ss, 0.1)
