"""Paired contrasts with percentile bootstrap intervals (design brief §5: 10,000 resamples, fixed seed)."""
from __future__ import annotations

import numpy as np

RESAMPLES = 10_000
SEED = 0


def bootstrap_mean(values, resamples: int = RESAMPLES, seed: int = SEED, level: float = 0.95) -> dict:
    """Mean and median of per-sample values (already paired differences), with a percentile interval of the
    mean from resampling the samples with replacement."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if not len(x):
        return {"n": 0, "mean": None, "median": None, "lo": None, "hi": None}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(resamples, len(x)))
    means = x[idx].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return {"n": int(len(x)), "mean": float(x.mean()), "median": float(np.median(x)), "lo": float(lo),
            "hi": float(hi)}
