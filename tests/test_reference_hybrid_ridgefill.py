"""The NumPy RidgeFill arm on qwen35 (reference_hybrid_ridgefill) reduces to the stock forward where it must, carries
the Gated DeltaNet states once in position order over filled and exact rows, keeps the probe's states apart, and
rescales the filled values as specified; each wrong variant misses. CPU NumPy only, float64."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ridgefill_gguf.random_gguf import tiny_shape, write_random_model
from ridgefill_gguf.reference_hybrid import HybridCache, HybridReference
from ridgefill_gguf.reference_hybrid_ridgefill import (HybridRidgeFill, hybrid_probe_scores,
                                                      hybrid_ridgefill_forward, stock_forward)
from test_reference_hybrid import long_memory_copy, rel

EXACT = 1e-9     # float64 identities: max |diff| / max |logit|; measured about 3e-15
WRONG = 1e-2     # a wrong variant must miss by at least this (measured: 0.1 to 0.9)
SPLIT, TAIL, N, N_PROBE = 2, 8, 40, 4
PREFIX = N - TAIL
EXACT_ROWS = (5, 17)  # besides row 0: exact prefix rows between filled ones


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """8 layers: DeltaNet 0-2, attention 3, DeltaNet 4-6, attention 7; late from layer 2 on, so both kinds are
    late, and a DeltaNet layer sits right at the split. Slow decay, so the recurrence carries memory."""
    folder = tmp_path_factory.mktemp("tiny-qwen35-8")
    path = write_random_model(folder / "stock.gguf", dataclasses.replace(tiny_shape("qwen35"), n_layer=8), seed=3)
    model = HybridReference(long_memory_copy(path, folder / "long-memory.gguf"))
    assert model.hp.recurrent == (True, True, True, False, True, True, True, False)
    return model


@pytest.fixture(scope="module")
def tokens():
    return [int(t) for t in np.random.default_rng(0).integers(1000, 5000, N)]


@pytest.fixture(scope="module")
def maps(ref):
    """Ridge maps for layers S+1..L-1: near the identity, with noise that makes the prediction wrong."""
    rng, d = np.random.default_rng(1), ref.hp.n_embd
    return {layer: (0.9 * np.eye(d) + rng.normal(0, 0.05, (d, d)), rng.normal(0, 0.05, d))
            for layer in range(SPLIT + 1, ref.hp.n_layer)}


@pytest.fixture(scope="module")
def stock(ref, tokens):
    return stock_forward(ref, tokens)


@pytest.fixture(scope="module")
def ridge(ref, tokens, maps):
    return hybrid_ridgefill_forward(ref, tokens, SPLIT, TAIL, "ridge", maps, exact_rows=EXACT_ROWS)


def run(cls, ref, tokens, maps, fill="ridge", exact_rows=EXACT_ROWS, **kw):
    return cls(ref, SPLIT, TAIL, fill, maps).forward(tokens, exact_rows, **kw)


# -- wrong variants -------------------------------------------------------------------------------------

class ReversedCarry(HybridRidgeFill):
    """Carries each DeltaNet span from its last row to its first."""

    def carry(self, layer, h, out_rows, conv, state):
        return super().carry(layer, h[::-1], len(h) - 1 - out_rows, conv, state)


class ResetAtExactRows(HybridRidgeFill):
    """Restarts the conv and recurrent states at every exact prefix row."""

    def carry(self, layer, h, out_rows, conv, state):
        if len(out_rows) == len(h):  # the tail: carried as it should be
            return super().carry(layer, h, out_rows, conv, state)
        bounds, outs = list(out_rows) + [len(h)], []
        for start, end in zip(bounds[:-1], bounds[1:]):
            out, conv, state = super().carry(layer, h[start:end], np.array([0]), None, None)
            outs.append(out)
        return np.concatenate(outs), conv, state


class FilledRowsSkipped(HybridRidgeFill):
    """Carries the prefix's states over its exact rows only."""

    def carry(self, layer, h, out_rows, conv, state):
        if len(out_rows) == len(h):
            return super().carry(layer, h, out_rows, conv, state)
        return super().carry(layer, h[out_rows], np.arange(len(out_rows)), conv, state)


class TrueInputsOnFilledDeltaNetRows(HybridRidgeFill):
    """Feeds the DeltaNet carry the filled rows' true inputs (what only the exact rows have)."""

    def forward(self, tokens, exact_rows=(), n_probe=0):
        self.truth = stock_forward(self.ref, tokens)[1]
        return super().forward(tokens, exact_rows, n_probe)

    def layer_input(self, layer, x, x_split, filled, truth):
        inp = super().layer_input(layer, x, x_split, filled, truth)
        if self.ref.hp.recurrent[layer]:
            inp[filled] = self.truth[layer][filled]
        return inp


class PredictedInputsOnExactDeltaNetRows(HybridRidgeFill):
    """Feeds the DeltaNet layers the prediction on the exact prefix rows too."""

    def layer_input(self, layer, x, x_split, filled, truth):
        inp = super().layer_input(layer, x, x_split, filled, truth)
        if self.ref.hp.recurrent[layer]:
            prefix = np.arange(len(x)) < len(x) - self.tail
            inp[prefix] = self.predicted(layer, x_split[prefix], None)
        return inp


class ProbeFromCarriedState(HybridRidgeFill):
    """Starts the probe rows' DeltaNet layers from the prefix's carried states."""

    def probe_state(self, cache, layer):
        return cache.conv[layer], cache.state[layer]


class ProbeWritesBack(HybridRidgeFill):
    """Leaves the probe rows' final DeltaNet states in the cache, where the tail then starts from them."""

    def probe_end(self, cache, layer, conv, state):
        cache.conv[layer], cache.state[layer] = conv, state


# -- tests ----------------------------------------------------------------------------------------------

def test_the_oracle_fill_reproduces_the_stock_forward_s_tail_logits_and_its_cache(ref, tokens, maps, stock):
    logits, info = hybrid_ridgefill_forward(ref, tokens, SPLIT, TAIL, "oracle", maps, exact_rows=EXACT_ROWS)
    err = rel(logits, stock[0][PREFIX:])
    print(f"oracle fill vs stock: {err:.1e}")
    assert logits.dtype == np.float64 and logits.shape == (TAIL, stock[0].shape[1])
    assert err < EXACT, err
    # the cache it leaves (every layer's K/V or states) is stock's: decoding on from it gives stock's logits
    cache = HybridCache()
    ref.forward(tokens, cache=cache)
    for layer in range(SPLIT, ref.hp.n_layer):
        fields = ("conv", "state") if ref.hp.recurrent[layer] else ("k", "v")
        assert all(rel(getattr(info["cache"], f)[layer], getattr(cache, f)[layer]) < EXACT for f in fields), layer
    more = [1234, 2345, 3456]
    assert rel(ref.forward(more, cache=info["cache"])[0], ref.forward(tokens + more)[0][N:]) < 1e-6  # float32 out


@pytest.mark.parametrize("fill", ["ridge", "identity"])
def test_every_prefix_row_exact_reproduces_the_stock_forward(fill, ref, tokens, maps, stock):
    logits, info = hybrid_ridgefill_forward(ref, tokens, SPLIT, TAIL, fill, maps, exact_rows=range(PREFIX))
    err = rel(logits, stock[0][PREFIX:])
    print(f"{fill}, every row exact, vs stock: {err:.1e}")
    assert info["exact"].all() and err < EXACT, err


def test_the_ridge_and_identity_fills_differ_from_stock_and_from_each_other(ref, tokens, maps, stock, ridge):
    identity, _ = hybrid_ridgefill_forward(ref, tokens, SPLIT, TAIL, "identity", maps, exact_rows=EXACT_ROWS)
    errs = rel(ridge[0], stock[0][PREFIX:]), rel(identity, stock[0][PREFIX:]), rel(ridge[0], identity)
    print("ridge vs stock %.2e, identity vs stock %.2e, ridge vs identity %.2e" % errs)
    assert min(errs) > WRONG, errs


def test_filled_rows_read_the_prediction_and_exact_rows_their_own_stream(ref, tokens, maps, stock, ridge):
    info = ridge[1]
    x_split, filled = stock[1][SPLIT], ~info["exact"]
    assert filled.sum() == PREFIX - 1 - len(EXACT_ROWS)
    assert rel(info["inputs"][SPLIT], x_split) < EXACT  # layer S: x_S for every row
    for layer in range(SPLIT + 1, ref.hp.n_layer):
        a, b = maps[layer]
        assert rel(info["inputs"][layer][filled], x_split[filled] @ a.T + b) < EXACT
    # row 0 sees nothing filled: its stream is stock's at every layer
    assert all(rel(info["inputs"][layer][0], stock[1][layer][0]) < EXACT for layer in range(SPLIT, ref.hp.n_layer))


def test_the_deltanet_states_are_carried_once_in_position_order_over_filled_and_exact_rows(ref, ridge):
    """Row by row through the stock DeltaNet layer, from the rows' inputs as the arm mixes them: the same states
    after the prefix and after the whole prompt."""
    info = ridge[1]
    for layer in range(SPLIT, ref.hp.n_layer):
        if not ref.hp.recurrent[layer]:
            continue
        h = ref.rms(info["inputs"][layer], ref.w(f"blk.{layer}.attn_norm.weight"))
        conv = state = None
        for row in range(N):
            _, conv, state = ref.gated_deltanet(layer, h[row: row + 1], conv, state)
            if row == PREFIX - 1:
                assert all(rel(a, b) < EXACT for a, b in zip(info["prefix_states"][layer], (conv, state))), layer
        assert rel(info["cache"].conv[layer], conv) < EXACT and rel(info["cache"].state[layer], state) < EXACT


@pytest.mark.parametrize("wrong", [ReversedCarry, ResetAtExactRows, FilledRowsSkipped,
                                   TrueInputsOnFilledDeltaNetRows])
def test_a_deltanet_carry_out_of_order_or_over_the_wrong_rows_changes_the_logits(wrong, ref, tokens, maps, stock,
                                                                                 ridge):
    err = rel(run(wrong, ref, tokens, maps)[0], ridge[0])
    print(f"{wrong.__name__}: misses the ridge arm by {err:.2e}")
    assert err > WRONG, err
    if wrong is not TrueInputsOnFilledDeltaNetRows:  # under the oracle fill it is the stock forward, rightly
        err = rel(run(wrong, ref, tokens, maps, fill="oracle")[0], stock[0][PREFIX:])
        print(f"{wrong.__name__}: the oracle fill misses stock by {err:.2e}")
        assert err > WRONG, err


def test_an_exact_row_feeds_its_true_input_to_the_deltanet_state(ref, tokens, maps, stock, ridge):
    err = rel(run(PredictedInputsOnExactDeltaNetRows, ref, tokens, maps)[0], ridge[0])
    print(f"exact rows' prediction in the DeltaNet layers: misses the ridge arm by {err:.2e}")
    assert err > WRONG, err
    err = rel(run(PredictedInputsOnExactDeltaNetRows, ref, tokens, maps, exact_rows=range(PREFIX))[0],
              stock[0][PREFIX:])
    print(f"... and with every prefix row exact, misses stock by {err:.2e}")
    assert err > WRONG, err


def test_the_probe_starts_its_deltanet_rows_empty_and_writes_nothing_back(ref, tokens, maps, ridge):
    logits, info = run(HybridRidgeFill, ref, tokens, maps, n_probe=N_PROBE)
    assert np.array_equal(logits, ridge[0])  # the probe ran between the prefix and the tail in every late layer
    for layer in range(SPLIT, ref.hp.n_layer):
        if ref.hp.recurrent[layer]:
            assert np.array_equal(info["cache"].state[layer], ridge[1]["cache"].state[layer])
            assert np.array_equal(info["cache"].conv[layer], ridge[1]["cache"].conv[layer])
        else:
            assert np.array_equal(info["cache"].v[layer], ridge[1]["cache"].v[layer])
    scores = info["probe_scores"]
    assert scores.shape == (PREFIX,) and np.array_equal(
        scores, hybrid_probe_scores(ref, tokens, SPLIT, TAIL, N_PROBE, maps, exact_rows=EXACT_ROWS))
    # every probe row's attention sums to 1 per head and late attention layer, over the prefix and the probe rows
    n_att = sum(not ref.hp.recurrent[layer] for layer in range(SPLIT, ref.hp.n_layer))
    assert 0 < scores.sum() < n_att * ref.hp.n_head * N_PROBE
    err = rel(run(ProbeWritesBack, ref, tokens, maps, n_probe=N_PROBE)[0], ridge[0])
    print(f"probe states written back: the tail's logits miss by {err:.2e}")
    assert err > WRONG, err
    carried = run(ProbeFromCarriedState, ref, tokens, maps, n_probe=N_PROBE)[1]["probe_scores"]
    err = rel(carried, scores)
    print(f"probe from the carried state: scores differ by {err:.2e}")
    assert err > WRONG, err


def test_the_value_rescale_scales_the_filled_v_by_the_per_head_ratio_of_the_tail_s_first_c_rows(ref, tokens, maps,
                                                                                                   ridge):
    c = 3
    logits, info = hybrid_ridgefill_forward(ref, tokens, SPLIT, TAIL, "ridge", maps, exact_rows=EXACT_ROWS,
                                            rescale_rows=c, rescale_values=True)
    exact, x_split = info["exact"], info["inputs"][SPLIT]
    pos, first = np.arange(N), np.arange(PREFIX, PREFIX + c)
    late_attention = [layer for layer in range(SPLIT + 1, ref.hp.n_layer) if not ref.hp.recurrent[layer]]
    assert len(late_attention) == 2
    for layer in late_attention:
        norm, (a, b) = ref.w(f"blk.{layer}.attn_norm.weight"), maps[layer]
        v_of = lambda x, rows: ref.kv(layer, ref.rms(x, norm), pos[rows])[1]  # noqa: E731
        v_true, v_pred = v_of(info["inputs"][layer][first], first), v_of(x_split[first] @ a.T + b, first)
        ratio = np.array([np.mean([np.linalg.norm(v_true[r, g]) for r in range(c)])
                          / np.mean([np.linalg.norm(v_pred[r, g]) for r in range(c)])
                          for g in range(ref.hp.n_head_kv)])
        print(f"layer {layer}: value factors {np.round(ratio, 4)}")
        assert np.abs(ratio - 1).max() > WRONG  # the rescale does something here
        v = info["cache"].v[layer]
        filled = np.flatnonzero(~exact)
        want = v_of(x_split[filled] @ a.T + b, filled) * ratio[None, :, None]
        assert rel(v[filled], want) < EXACT
        assert rel(v[exact], v_of(info["inputs"][layer][exact], np.flatnonzero(exact))) < EXACT
        assert rel(info["cache"].k[layer][filled], ref.kv(layer, ref.rms(x_split[filled] @ a.T + b, norm),
                                                          filled)[0]) < EXACT  # keys are not scaled
    err = rel(logits, ridge[0])
    print(f"rescaled vs not: {err:.2e}")
    assert err > 1e-4, err
