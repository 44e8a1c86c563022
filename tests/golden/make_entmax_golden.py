"""Regenerate ``entmax_golden.json``: reference values from the PyTorch ``entmax`` package.

The test ``tests/test_golden_entmax.py`` compares ``sparse_jax`` against the values in
``entmax_golden.json``. This script is the only place that needs ``torch`` and ``entmax``;
they are *not* dependencies of ``sparse_jax`` and are only required to regenerate the
fixture. Keep them in a separate virtualenv, e.g.::

    python3 -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.13.0 entmax==1.3 numpy
    /tmp/torchenv/bin/python tests/golden/make_entmax_golden.py

(run from the repository root). The committed fixture was produced with Python 3.11,
torch 2.13.0 (CPU), entmax 1.3 and numpy 2.4; the exact versions are recorded in the
JSON's ``meta`` block.

Everything is computed in float64. Inputs are drawn from a fixed numpy seed and then
rounded to float32-representable values, so the float32 tests see exactly the same
inputs as the float64 ones. ``entmax_bisect`` runs for ``N_ITER`` = 200 bisection steps,
which is far past float64 convergence (the bracket collapses after ~60 halvings).

Before writing, the script checks that

* no input sits close to a support boundary (``|(alpha-1) x_i - tau| >= MIN_MARGIN``),
  so implementations that find the threshold differently agree on the support and the
  function is smooth around every input;
* ``entmax_bisect`` agrees with the closed forms at alpha=2 (sparsemax) and alpha=1.5;
* every stored gradient matches central finite differences.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import entmax
import numpy as np
import torch

SEED = 20240611
N_ITER = 200
ALPHAS = (1.25, 1.5, 1.75, 2.0)
MIN_MARGIN = 1e-3
OUT_PATH = Path(__file__).with_name("entmax_golden.json")

FIELDS = {
    "meta": "versions and settings used to generate this file",
    "alphas": "alpha values used for entmax_bisect / EntmaxBisectLoss",
    "rows[].name": "short label of the test row",
    "rows[].x": "1-D input logits (float32-representable values, computed in float64)",
    "rows[].g": "cotangent used for the vector-Jacobian products of this row",
    "rows[].sparsemax.p": "entmax.sparsemax(x, dim=-1)",
    "rows[].sparsemax.vjp_x": "d/dx sum(g * sparsemax(x))",
    "rows[].entmax15.p": "entmax.entmax15(x, dim=-1)",
    "rows[].entmax15.vjp_x": "d/dx sum(g * entmax15(x))",
    "rows[].entmax_bisect[].alpha": "alpha of this entry",
    "rows[].entmax_bisect[].p": "entmax.entmax_bisect(x, alpha, dim=-1, n_iter=200)",
    "rows[].entmax_bisect[].vjp_x": "d/dx sum(g * entmax_bisect(x, alpha))",
    "rows[].entmax_bisect[].vjp_alpha": "d/dalpha sum(g * entmax_bisect(x, alpha)), scalar",
    "losses.logits": "batch of logits, shape (batch, classes)",
    "losses.labels": "integer target class per row, shape (batch,)",
    "losses.w": "cotangent for the per-example losses, shape (batch,)",
    "losses.<name>.loss": "per-example Fenchel-Young loss (reduction='none')",
    "losses.<name>.grad": "d/dlogits sum(loss) (equals p - onehot(label))",
    "losses.<name>.vjp": "d/dlogits sum(w * loss)",
    "losses.<name>": (
        "sparsemax: entmax.SparsemaxLoss; entmax15: entmax.Entmax15Loss; "
        "entmax_bisect: list over alphas of entmax.EntmaxBisectLoss(alpha, n_iter=200)"
    ),
}


def _f32(a: np.ndarray) -> np.ndarray:
    """Round to the nearest float32 value, returned as float64."""
    return np.asarray(a, dtype=np.float64).astype(np.float32).astype(np.float64)


def make_rows(rng: np.random.Generator) -> list[tuple[str, np.ndarray]]:
    """Fixed test rows of different lengths and regimes."""
    rows = [
        ("single", np.array([0.37])),
        ("pair", np.array([0.3, -0.1])),
        ("one_hot", np.array([8.0, 0.1, -0.3, 0.5, 0.2])),
        ("ties", np.array([1.2, 1.2, 0.5, -2.5, -2.5, 0.1, 1.2])),
        ("generic", 1.5 * rng.standard_normal(12)),
        ("tiny", 1e-4 * rng.standard_normal(16)),
        ("large", 1e3 + 1.5 * rng.standard_normal(33)),
    ]
    return [(name, _f32(x)) for name, x in rows]


def _t(a) -> torch.Tensor:
    return torch.tensor(np.asarray(a), dtype=torch.float64)


def _normalizers() -> dict:
    """name -> (callable(x, alpha) -> p, alpha or None)."""
    out = {
        "sparsemax": (lambda x, a: entmax.sparsemax(x, dim=-1), None),
        "entmax15": (lambda x, a: entmax.entmax15(x, dim=-1), None),
    }
    for alpha in ALPHAS:
        out[f"bisect_{alpha}"] = (
            lambda x, a: entmax.entmax_bisect(x, a, dim=-1, n_iter=N_ITER),
            alpha,
        )
    return out


def eval_normalizer(fn, x: np.ndarray, g: np.ndarray, alpha: float | None) -> dict:
    """Forward value and VJPs (w.r.t. x and, if given, alpha) of one normalizer."""
    xt = _t(x).requires_grad_(True)
    at = None if alpha is None else _t(alpha).requires_grad_(True)
    p = fn(xt, at)
    (p * _t(g)).sum().backward()
    out = {"p": p.detach().numpy(), "vjp_x": xt.grad.numpy()}
    if at is not None:
        out["vjp_alpha"] = float(at.grad)
    return out


def support_margin(x: np.ndarray, p: np.ndarray, alpha: float) -> float:
    """Distance of the closest input to the threshold, in the scaled domain (alpha-1) x."""
    z = (alpha - 1.0) * x
    on = p > 0
    tau = np.mean(z[on] - p[on] ** (alpha - 1.0))
    off = z[~on]
    gaps = list(z[on] - tau) + list(tau - off)
    return float(min(gaps))


def check_fd(fn, x: np.ndarray, g: np.ndarray, alpha, res: dict, eps: float = 1e-5) -> None:
    """Compare the autograd VJPs with central finite differences."""

    def obj(xv, av):
        with torch.no_grad():
            return float((fn(_t(xv), None if av is None else _t(av)) * _t(g)).sum())

    fd = np.array(
        [(obj(x + eps * e, alpha) - obj(x - eps * e, alpha)) / (2 * eps) for e in np.eye(len(x))]
    )
    np.testing.assert_allclose(res["vjp_x"], fd, rtol=1e-5, atol=1e-6)
    if alpha is not None:
        fd_a = (obj(x, alpha + eps) - obj(x, alpha - eps)) / (2 * eps)
        np.testing.assert_allclose(res["vjp_alpha"], fd_a, rtol=1e-5, atol=1e-6)


def golden_rows(rng: np.random.Generator) -> list[dict]:
    rows = []
    for name, x in make_rows(rng):
        g = _f32(rng.standard_normal(len(x)))
        res = {}
        for key, (fn, alpha) in _normalizers().items():
            res[key] = eval_normalizer(fn, x, g, alpha)
            check_fd(fn, x, g, alpha, res[key])
            if len(x) > 1:
                a = 1.5 if key == "entmax15" else 2.0 if key == "sparsemax" else alpha
                margin = support_margin(x, res[key]["p"], a)
                assert margin >= MIN_MARGIN, (name, key, margin)
        for closed, bisect in (("sparsemax", "bisect_2.0"), ("entmax15", "bisect_1.5")):
            np.testing.assert_allclose(res[closed]["p"], res[bisect]["p"], atol=1e-13)
            np.testing.assert_allclose(res[closed]["vjp_x"], res[bisect]["vjp_x"], atol=1e-12)

        def lists(d: dict) -> dict:
            return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in d.items()}

        rows.append(
            {
                "name": name,
                "x": x.tolist(),
                "g": g.tolist(),
                "sparsemax": lists(res["sparsemax"]),
                "entmax15": lists(res["entmax15"]),
                "entmax_bisect": [{"alpha": a, **lists(res[f"bisect_{a}"])} for a in ALPHAS],
            }
        )
    return rows


def eval_loss(loss_fn, logits: np.ndarray, labels: np.ndarray, w: np.ndarray) -> dict:
    lt = _t(logits).requires_grad_(True)
    yt = torch.tensor(labels, dtype=torch.long)
    loss = loss_fn(lt, yt)
    (grad,) = torch.autograd.grad(loss.sum(), lt, retain_graph=True)
    (vjp,) = torch.autograd.grad((loss * _t(w)).sum(), lt)
    return {
        "loss": loss.detach().numpy().tolist(),
        "grad": grad.numpy().tolist(),
        "vjp": vjp.numpy().tolist(),
    }


def golden_losses(rng: np.random.Generator) -> dict:
    logits = 1.5 * rng.standard_normal((4, 7))
    logits[3] = [0.2, -0.4, 6.0, 0.1, -1.0, 0.3, 0.0]
    logits = _f32(logits)
    labels = np.array(
        [
            np.argmin(logits[0]),  # label far outside the support: large loss
            np.argsort(logits[1])[-2],  # runner-up class, inside the support
            np.argmax(logits[2]),  # top class (one-hot for sparsemax only)
            2,  # one-hot prediction on the label: zero loss
        ]
    )
    w = _f32(rng.standard_normal(4))
    # ignore_index=-100 (default) disables masking; reduction='none' keeps per-row losses.
    out = {
        "logits": logits.tolist(),
        "labels": labels.tolist(),
        "w": w.tolist(),
        "sparsemax": eval_loss(entmax.SparsemaxLoss(reduction="none"), logits, labels, w),
        "entmax15": eval_loss(entmax.Entmax15Loss(reduction="none"), logits, labels, w),
        "entmax_bisect": [
            {
                "alpha": a,
                **eval_loss(
                    entmax.EntmaxBisectLoss(alpha=a, n_iter=N_ITER, reduction="none"),
                    logits,
                    labels,
                    w,
                ),
            }
            for a in ALPHAS
        ],
    }
    # Sanity: grad == p - onehot, loss >= 0, zero loss on the one-hot row.
    onehot = np.eye(logits.shape[1])[labels]
    p = np.asarray(out["sparsemax"]["grad"]) + onehot
    np.testing.assert_allclose(p, entmax.sparsemax(_t(logits), dim=-1).numpy(), atol=1e-15)
    for entry in [out["sparsemax"], out["entmax15"], *out["entmax_bisect"]]:
        assert min(entry["loss"]) >= 0.0 and abs(entry["loss"][3]) < 1e-12, entry["loss"]
    return out


def main() -> None:
    torch.set_default_dtype(torch.float64)
    rng = np.random.default_rng(SEED)
    data = {
        "meta": {
            "generator": "tests/golden/make_entmax_golden.py",
            "entmax_version": entmax.__version__,
            "torch_version": torch.__version__,
            "numpy_version": np.__version__,
            "python_version": platform.python_version(),
            "dtype": "float64",
            "seed": SEED,
            "entmax_bisect_n_iter": N_ITER,
            "fields": FIELDS,
        },
        "alphas": list(ALPHAS),
        "rows": golden_rows(rng),
        "losses": golden_losses(rng),
    }
    OUT_PATH.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT_PATH} ({OUT_PATH.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
