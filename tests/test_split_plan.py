"""The layer-split model (ridgefill_gguf/split_plan.py) agrees with the bench's MAC ceiling on one device, pipelines
the stock prefill as llama.cpp's pipeline parallelism does, counts the bytes each boundary moves, and never gets
faster on a slower link."""
from __future__ import annotations

import dataclasses

import pytest

from ridgefill_gguf.bench import mac_ceiling
from ridgefill_gguf.random_gguf import REAL_SHAPES
from ridgefill_gguf.split_plan import LINKS, Link, Workload, balanced_split, even_split, ridgefill_costs, simulate

FREE = Link("free", float("inf"), 0.0)
RATE = 60e12


def test_on_one_device_the_model_gives_the_bench_mac_ceiling_of_plain_ridgefill():
    s, w = REAL_SHAPES["qwen3-8b"], Workload(n=32768, split=13, tail=4096)
    r = simulate(s, w, even_split(s.n_layer, 1), FREE, RATE)
    want = mac_ceiling(s, w.n, w.split, w.n - w.tail, w.tail, tail=w.tail)
    assert r["speedup"] == pytest.approx(want, rel=1e-9)


def test_the_stock_prefill_pipelines_its_ubatches_over_the_devices_four_in_flight():
    s, w = REAL_SHAPES["qwen3-8b"], Workload(n=32768, split=13)
    one = simulate(s, w, even_split(s.n_layer, 1), FREE, RATE)["stock_s"]
    n_ub = w.n // w.ubatch
    for n_dev in (2, 4):
        got = simulate(s, w, even_split(s.n_layer, n_dev), FREE, RATE)["stock_s"]
        # the slowest device's share of the layers for every ubatch, and the others' for the first one
        shares = [hi - lo for lo, hi in zip(even_split(s.n_layer, n_dev), even_split(s.n_layer, n_dev)[1:])]
        want = one / s.n_layer * (max(shares) * n_ub + (s.n_layer - max(shares))) / n_ub
        assert got == pytest.approx(want, rel=1e-6), n_dev
    # eight devices, four ubatches in flight: a ubatch waits for the one four before it to leave the last device
    per_layer = one / s.n_layer / n_ub
    got = simulate(s, w, [0, 5, 9, 14, 18, 23, 27, 32, 36], FREE, RATE)["stock_s"]
    assert got > (5 * n_ub + 31) * per_layer * (1 + 1e-6)
    assert got == pytest.approx(n_ub / 4 * s.n_layer * per_layer, rel=0.05)


def test_each_boundary_moves_every_rows_hidden_state_once_a_hop():
    s, w = REAL_SHAPES["gemma3-12b"], Workload(n=16384, split=16, tail=4096, exact_share=0.25)
    for key in ("nvlink", "rpc-10g"):
        link = LINKS[key]
        r = simulate(s, w, even_split(s.n_layer, 4), link, RATE)
        row = 4 * s.n_embd * link.hops
        n_exact = w.tail + round(0.25 * (w.n - w.tail))
        assert r["bytes"]["stock"] == 3 * w.n * row
        assert r["bytes"]["sweep_one"] == 1 * w.n * row  # layer 12 | 24 are the boundaries below and above 16
        assert r["bytes"]["x_split"] == 2 * w.n * row  # the split's device holds late layers 16-23 itself
        assert r["bytes"]["late_units"] == 2 * n_exact * row


@pytest.mark.parametrize("preset", ["qwen3-8b", "gemma3-12b", "qwen35-27b"])
def test_a_slower_link_never_makes_a_prefill_faster(preset):
    s = REAL_SHAPES[preset]
    w = Workload(n=16384, split=s.n_layer // 4, exact_share=0.24)
    rf = ridgefill_costs(s, w)
    for bounds in (even_split(s.n_layer, 4), balanced_split(rf, 4)):
        for overlap in (False, True):
            times = [simulate(s, w, bounds, link, RATE, overlap) for link in
                     (FREE, LINKS["nvlink"], LINKS["pcie5"], LINKS["rpc-100g"], LINKS["rpc-10g"])]
            for key in ("stock_s", "ridgefill_s"):
                seq = [t[key] for t in times]
                assert seq == sorted(seq), (preset, bounds, overlap, key, seq)
    assert balanced_split(rf, 4)[0] == 0 and balanced_split(rf, 4)[-1] == s.n_layer
