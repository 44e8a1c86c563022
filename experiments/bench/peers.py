"""PyTorch peers of the kernels benchmark, run in their own process (torch is never imported by
sparse_jax): ``python -m experiments.bench.peers '<json request>'`` prints one JSON object per
line, each as soon as its peer is measured (a run stopped at its time limit keeps those).

The request holds the shapes (``batch``, ``heads``, ``head_dim``, ``dtype``, ``repeats``) and
``cells``: ``[{"mask": name, "n": n, "normalizer": name, "window": w}, ...]``. Each cell is timed
for every peer that computes it, forward and forward+backward (gradient of ``sum(out * g)``),
median of ``repeats`` calls after two warm-up calls, CUDA-synchronised:

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (softmax; ``is_causal`` for
  the causal mask, a boolean mask otherwise up to n = 16384);
* ``flex``: FlexAttention compiled with ``torch.compile``, with the block mask of the same mask
  (softmax);
* ``adasplash``: AdaSplash-2 for 1.5-entmax, AdaSplash-1 for other α (sparsemax is α = 2),
  causal mask only (what the package computes).

Run on a CUDA machine with torch (and optionally adasplash) installed; elsewhere it prints
nothing on stdout and says why on stderr.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time


def _time(fn, repeats: int) -> float:
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _time_peer(fwd, tensors, repeats: int) -> tuple[float, float]:
    """(forward ms, forward+backward ms) of ``fwd(q, k, v)``; g is the output's cotangent."""
    import torch

    q, k, v, g = tensors
    leaves = tuple(x.detach().requires_grad_(True) for x in (q, k, v))

    def forward_backward():
        out = fwd(*leaves)
        torch.autograd.grad((out * g).sum(), leaves)

    with torch.no_grad():
        fwd_ms = _time(lambda: fwd(q, k, v), repeats)
    return fwd_ms, _time(forward_backward, repeats)


def _mask_mod(name: str, window: int):
    def causal(b, h, q, k):
        return q >= k

    def local(b, h, q, k):
        return (q >= k) & (q - k <= window)

    def local_sink(b, h, q, k):
        return ((q >= k) & (q - k <= window)) | (k < 4)

    return {"causal": causal, "local": local, "local_sink": local_sink}[name]


def _peers(cell: dict, request: dict):
    """(peer name, forward function of q, k, v) for every peer that computes the cell."""
    import torch
    import torch.nn.functional as F

    name, n, norm, window = cell["mask"], cell["n"], cell["normalizer"], cell["window"]
    sdpa = F.scaled_dot_product_attention
    out = []
    if norm == "softmax":
        if name == "causal":
            out.append(("sdpa", lambda q, k, v: sdpa(q, k, v, is_causal=True)))
        elif n <= 16384:
            idx = torch.arange(n, device="cuda")
            allowed = _mask_mod(name, window)(None, None, idx[:, None], idx[None, :])
            out.append(("sdpa", lambda q, k, v: sdpa(q, k, v, attn_mask=allowed)))
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block_mask = create_block_mask(_mask_mod(name, window), None, None, n, n, device="cuda")
        flex = torch.compile(flex_attention)
        out.append(("flex", lambda q, k, v: flex(q, k, v, block_mask=block_mask)))
    elif name == "causal" and importlib.util.find_spec("adasplash") is not None:
        import adasplash

        alpha = float({"sparsemax": 2.0, "entmax15": 1.5}.get(norm, norm))
        if alpha == 1.5:
            out.append(("adasplash-2", adasplash.adasplash_v2))
        else:

            def v1(q, k, v):
                return adasplash.adasplash_v1(q, k, v, alpha=alpha, is_causal=True)

            out.append(("adasplash-1", v1))
    return out


def _autotuned_configs(package: str) -> dict[str, str]:
    """The configs Triton's autotuner chose (``best_config``) for the autotuned kernels of a
    package's loaded modules: recorded beside the timings, so that a later run can be checked
    against, or pinned to, what the package picked for itself on this GPU."""
    found = {}
    for name, module in list(sys.modules.items()):
        if name != package and not name.startswith(package + "."):
            continue
        for attr, obj in vars(module).items():
            best = getattr(obj, "best_config", None)
            if best is not None and type(obj).__name__ == "Autotuner":
                found[f"{name.rsplit('.', 1)[-1]}.{attr}"] = str(best)
    return found


def main(argv: list[str]) -> None:
    request = json.loads(argv[0])
    if importlib.util.find_spec("torch") is None:
        print("bench_peers: torch is not importable: no peers measured", file=sys.stderr)
        return
    import torch

    if not torch.cuda.is_available():
        print("bench_peers: no CUDA device: no peers measured", file=sys.stderr)
        return
    dtype = getattr(torch, request["dtype"])
    b, h, d = request["batch"], request["heads"], request["head_dim"]
    # Softmax cells (SDPA, FlexAttention) first: AdaSplash's first Triton compilation took
    # minutes on an H200, and a run stopped at its time limit keeps the rows printed before.
    for cell in sorted(request["cells"], key=lambda cell: cell["normalizer"] != "softmax"):
        n = cell["n"]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, g = (
            torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(4)
        )
        for peer, fwd in _peers(cell, request):
            start = time.perf_counter()
            try:
                fwd_ms, both_ms = _time_peer(fwd, (q, k, v, g), request["repeats"])
                row = {**cell, "peer": peer, "fwd_ms": fwd_ms, "fwd_bwd_ms": both_ms}
                if peer.startswith("adasplash"):
                    row["autotuned"] = _autotuned_configs("adasplash")
            except Exception as err:  # one peer failing (OOM, unsupported) must not stop the rest
                row = {**cell, "peer": peer, "error": f"{type(err).__name__}: {err}"[:200]}
            print(json.dumps(row), flush=True)
            seconds = time.perf_counter() - start  # compilation included
            print(f"bench_peers: {peer} {cell} done in {seconds:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
