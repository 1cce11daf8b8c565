"""Paired contrasts with percentile bootstrap intervals (design brief §5: 10,000 resamples, fixed seed)."""
from __future__ import annotations

import numpy as np

RESAMPLES = 10_000
SEED = 0


def bootstrap_mean(values, resamples: int = RESAMPLES, seed: int = SEED, level: float = 0.95, strata=None) -> dict:
    """Mean and median of per-sample values (already paired differences), with a percentile interval of the
    mean from resampling the samples with replacement (within each stratum when `strata` names one per value)."""
    x, st = _finite(values, strata)
    if not len(x):
        return {"n": 0, "mean": None, "median": None, "lo": None, "hi": None}
    means = _resampled_means(x, resamples, seed, st)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return {"n": int(len(x)), "mean": float(x.mean()), "median": float(np.median(x)), "lo": float(lo),
            "hi": float(hi)}


def binomial_floor(n: int, alpha: float = 0.05) -> float:
    """Paper §3.4: n samples cannot rule out a failure rate below 1 - alpha^(1/n) (about 3/n), however well the arms
    agree; a non-inferiority bound never claims more (as a fraction: -0.048 at n = 61)."""
    return -(1.0 - alpha ** (1.0 / n))


def noninferiority(values, margin: float, resamples: int = RESAMPLES, seed: int = SEED, alpha: float = 0.05,
                   strata=None) -> dict:
    """Paper §3.4's test of arm minus reference (paired per sample): the one-sided (1 - alpha) lower bound is the
    more conservative of the bootstrap bound and the binomial floor; the arm is non-inferior when the bound lies
    above -margin. `strata` (one per value, e.g. the task) resamples within each, as §3.4 does per task."""
    x, st = _finite(values, strata)
    if not len(x):
        return {"n": 0, "bootstrap_bound": None, "floor": None, "bound": None, "margin": margin, "holds": False}
    boot = float(np.quantile(_resampled_means(x, resamples, seed, st), alpha))
    floor = binomial_floor(len(x), alpha)
    bound = min(boot, floor)
    return {"n": int(len(x)), "bootstrap_bound": boot, "floor": floor, "bound": bound, "margin": margin,
            "holds": bool(bound > -margin)}


def _finite(values, strata=None) -> tuple[np.ndarray, np.ndarray | None]:
    x = np.asarray(values, dtype=np.float64)
    keep = np.isfinite(x)
    return x[keep], None if strata is None else np.asarray(strata)[keep]


def _resampled_means(x: np.ndarray, resamples: int, seed: int, strata: np.ndarray | None = None) -> np.ndarray:
    """The means of `resamples` draws of len(x) samples with replacement, from a fixed seed; with strata, each
    stratum's samples are drawn from that stratum alone, so every resample keeps the mix (paper §3.4)."""
    rng = np.random.default_rng(seed)
    labels = [] if strata is None else sorted(set(strata.tolist()))
    # a stratum of one value would never vary and narrow the interval: then resample across strata
    if strata is None or any(np.count_nonzero(strata == s) < 2 for s in labels):
        return x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)
    total = np.zeros(resamples)
    for s in labels:
        xs = x[strata == s]
        total += xs[rng.integers(0, len(xs), size=(resamples, len(xs)))].sum(axis=1)
    return total / len(x)


def mean_or_none(xs) -> float | None:
    """The plain mean of a list, None when it is empty (an arm with no sample in a group)."""
    return sum(xs) / len(xs) if xs else None
