"""Exact float64 numpy references for the normalizers, by sorting (the textbook algorithms).

Used by the tests only. Rows are the last axis; ``-inf`` entries are masked; rows with no finite
entry give zeros.
"""

from __future__ import annotations

import numpy as np


def _rows(x):
    x = np.asarray(x, np.float64)
    return x.reshape(-1, x.shape[-1]), x.shape


def sparsemax_ref(x):
    """Sort-based sparsemax (Martins & Astudillo 2016, Algorithm 1)."""
    rows, shape = _rows(x)
    out = np.zeros_like(rows)
    for r, row in enumerate(rows):
        finite = np.isfinite(row)
        if not finite.any():
            continue
        z = np.sort(row[finite])[::-1]
        k = np.arange(1, z.size + 1)
        cumsum = np.cumsum(z)
        support = 1 + k * z > cumsum
        k_max = k[support][-1]
        tau = (cumsum[k_max - 1] - 1) / k_max
        out[r, finite] = np.maximum(row[finite] - tau, 0)
    return out.reshape(shape)


def entmax15_ref(x):
    """Sort-based 1.5-entmax (Peters et al. 2019, Algorithm 2): p = [x/2 - τ]_+²."""
    rows, shape = _rows(x)
    out = np.zeros_like(rows)
    for r, row in enumerate(rows):
        finite = np.isfinite(row)
        if not finite.any():
            continue
        z = (row[finite] - row[finite].max()) / 2
        zs = np.sort(z)[::-1]
        k = np.arange(1, zs.size + 1)
        mean = np.cumsum(zs) / k
        mean_sq = np.cumsum(zs**2) / k
        ss = k * (mean_sq - mean**2)
        delta = (1 - ss) / k
        tau = mean - np.sqrt(np.maximum(delta, 0))
        k_max = k[tau <= zs][-1]
        out[r, finite] = np.maximum(z - tau[k_max - 1], 0) ** 2
    return out.reshape(shape)


def entmax_ref(x, alpha, iterations: int = 200):
    """α-entmax by float64 bisection on τ to machine precision (exact up to float64 rounding).

    ``alpha``: a float or an array broadcastable to ``x.shape[:-1]``.
    """
    rows, shape = _rows(x)
    alphas = np.broadcast_to(np.asarray(alpha, np.float64), shape[:-1]).reshape(-1)
    out = np.zeros_like(rows)
    for r, (row, a) in enumerate(zip(rows, alphas, strict=True)):
        finite = np.isfinite(row)
        if not finite.any():
            continue
        z = (a - 1) * (row[finite] - row[finite].max())
        lo, hi = -1.0, -((1.0 / finite.sum()) ** (a - 1))
        for _ in range(iterations):
            mid = 0.5 * (lo + hi)
            if (np.maximum(z - mid, 0) ** (1 / (a - 1))).sum() >= 1:
                lo = mid
            else:
                hi = mid
        p = np.maximum(z - lo, 0) ** (1 / (a - 1))
        out[r, finite] = p / p.sum()
    return out.reshape(shape)
