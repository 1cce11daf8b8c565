"""The closed-form ridge solve (paper §2.2), from running sums, in float64.

Centered ridge with an unpenalized bias: with X, Y_l centered by their means,
  A_l = Y_lᵀX (XᵀX + αI)⁻¹,  b_l = μ_l − A_l μ_S,  α = λ·tr(XᵀX)/d_in.
One Cholesky factor per (split, λ) serves every layer of the split.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .sums import SplitSums

DEFAULT_LAMBDAS = tuple(float(x) for x in np.logspace(-4, 0, 9))  # 1e-4 ... 1, nine values


@dataclass
class LayerSolution:
    layer: int
    weight: np.ndarray  # float32 [d_out, d_in]
    bias: np.ndarray    # float32 [d_out]


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def centered(ss: SplitSums) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(XᵀX centered, μ_S, n) in float64."""
    ss.flush()
    if ss.n < 2:
        raise ValueError(f"split {ss.split}: {ss.n} rows, too few to fit")
    n = float(ss.n)
    mu_x = torch.from_numpy(ss.sum_x / n)
    cxx = torch.from_numpy(ss.xtx) - n * torch.outer(mu_x, mu_x)
    return cxx, mu_x, n


def solve(ss: SplitSums, lam: float, layers: list[int] | None = None,
          device: torch.device | None = None) -> dict[int, LayerSolution]:
    device = device or default_device()
    layers = layers or ss.layers
    cxx, mu_x, n = centered(ss)
    d_in = cxx.shape[0]
    alpha = lam * float(torch.trace(cxx)) / d_in
    m = (cxx + alpha * torch.eye(d_in, dtype=torch.float64)).to(device)
    chol, info = torch.linalg.cholesky_ex(m)
    if int(info) != 0:
        raise ValueError(f"split {ss.split}, lambda {lam}: XᵀX + αI is not positive definite "
                         "(too few distinct rows, or lambda 0)")
    out = {}
    for layer in layers:
        mu_y = torch.from_numpy(ss.sum_y[layer] / n)
        cxy = (torch.from_numpy(ss.xty[layer]) - n * torch.outer(mu_x, mu_y)).to(device)  # [d_in, d_out]
        at = torch.cholesky_solve(cxy, chol).cpu()                                          # [d_in, d_out]
        a = at.T.contiguous()
        b = mu_y - a @ mu_x
        out[layer] = LayerSolution(layer, a.numpy().astype(np.float32), b.numpy().astype(np.float32))
    return out
