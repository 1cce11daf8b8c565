"""Which scored tokens matter (paper §3.1): novel tokens and key tokens."""
from __future__ import annotations

import numpy as np

NGRAM = 8          # a token inside an 8-token run seen earlier in the document is not novel
KEY_NATS = 2.0     # a key token's exact loss rises by more than this when the context is cut to the tail


def novel_mask(tokens, start: int, n: int = NGRAM) -> np.ndarray:
    """For tokens[start:], True where the token lies inside no n-token run that also appears earlier in the
    document (an earlier start)."""
    toks = list(tokens)
    first: dict[tuple, int] = {}
    repeated = np.zeros(len(toks), dtype=bool)  # by window start
    for j in range(len(toks) - n + 1):
        gram = tuple(toks[j:j + n])
        k = first.setdefault(gram, j)
        repeated[j] = k < j
    inside = np.zeros(len(toks), dtype=bool)
    for j in np.flatnonzero(repeated):
        inside[j:j + n] = True
    return ~inside[start:]


def key_mask(nll_full, nll_cut, nats: float = KEY_NATS) -> np.ndarray:
    """True where cutting the context raises the exact loss by more than `nats`."""
    return (np.asarray(nll_cut, np.float64) - np.asarray(nll_full, np.float64)) > nats


def token_nll(logits: np.ndarray, targets) -> np.ndarray:
    """Negative log-likelihood of each target under the row of logits that predicts it (float64)."""
    x = np.asarray(logits, np.float64)
    lse = np.logaddexp.reduce(x, axis=1)
    return lse - x[np.arange(len(x)), np.asarray(targets)]
