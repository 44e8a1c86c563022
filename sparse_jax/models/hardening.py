"""Hardening: turn learned candidate weights and gates into a smaller, fixed sparse GPT-2.

:func:`harden` reads a trained :class:`~sparse_jax.models.gpt2.GPT2` student and returns a new
model that does less work:

* candidate-mask attention becomes a fixed per-head :class:`~sparse_jax.masks.Mask`: for each
  head, the union of the candidates it keeps (weight ``sigmoid(logit) >= threshold``, or the
  lowest threshold that meets a density ``budget``; a head always keeps at least its strongest
  candidate), run by ``sparse_jax.attention`` (block-sparse when the union leaves enough out).
  The layer answers what it keeps (``kept_candidates``, ``head_masks``,
  ``candidate_densities``); densities are those of :mod:`sparse_jax.models.flops`;
* a head that keeps a data-dependent candidate (a :class:`~sparse_jax.dynamic.BlockSelection`)
  keeps it: its :class:`~sparse_jax.models.layers.FixedAttention` adds the blocks the selection
  chooses in each call to the union of its kept static candidates (exact: the selection's
  gather engine where it is alone and cheap enough, see
  :func:`~sparse_jax.models.selections.gathers`, else the XLA engine on a dense mask), with
  the gate of a learned selection (:class:`~sparse_jax.block_gate.LearnedBlockSelection`)
  for its kept heads; its
  density and block cost are upper bounds;
* heads whose gate is closed are removed from ``c_attn`` and ``c_proj`` (smaller matrices, not
  zeros), FFN units likewise from ``c_fc`` and ``c_proj``; the gate values of the units that
  stay are folded into ``c_proj``, and a ``score_scaling`` head gate (a temperature) is folded
  into the query projection.

Exactness: with ``combine="soft_union"`` and weights at 0/1 the union mask is the soft model's
mask; gates of kind ``"sigmoid_ste"`` are already 0/1 in the forward pass. The hardened model
then computes the same function as the soft one ("the soft model with its gates set to their
hard values"). ``"soft_mask"`` (a sum of masks) and ``"mixture"`` (an average of outputs) are
approximated by the union of the kept candidates.

Example:
  >>> from flax import nnx
  >>> from sparse_jax.models.gpt2 import GPT2, AttentionSpec, GPT2Config
  >>> spec = AttentionSpec(kind="candidates", granularity="head", head_gate="sigmoid_ste")
  >>> student = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))
  >>> hard = harden(student)
  >>> hard.config.heads_per_layer, type(hard.h[0].attn.core).__name__
  ((3, 3), 'FixedAttention')
"""

from __future__ import annotations

import dataclasses
import numbers

import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax import masks as masks_lib
from sparse_jax.models.flops import (
    mask_block_cost,
    mask_density,
    selection_block_cost,
    serving_block_size,
)
from sparse_jax.models.gpt2 import GPT2, AttentionSpec
from sparse_jax.models.layers import SELF, CandidateMaskAttention, Gate
from sparse_jax.models.selections import union_density_bound
from sparse_jax.validation import check_choice, check_int

__all__ = ["HardenReport", "harden", "harden_plan"]


@dataclasses.dataclass(frozen=True)
class HardenReport:
    """What :func:`harden_plan` decided, per block.

    Example:
      >>> from sparse_jax.masks import causal, local
      >>> from sparse_jax.models.gpt2 import GPT2Config
      >>> cands = (causal() & local(1, 0), causal())  # C = 2: the last 2 keys, or all
      >>> spec = AttentionSpec(kind="candidates", candidates=cands, granularity="head",
      ...                      head_gate="sigmoid_ste")
      >>> student = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))  # 3 heads a block
      >>> student.h[0].attn.head_gate.logits[...] = jnp.array([1.0, -1.0, 1.0])  # closes head 1
      >>> for block in student.h:  # candidate logits [N, C]: heads 0, 1 the window, 2 causal
      ...     block.attn.core.logits[...] = jnp.array([[1.0, -1.0], [1.0, -1.0], [-1.0, 1.0]])
      >>> report = harden_plan(student, length=8)
      >>> [heads.tolist() for heads in report.kept_heads], [len(u) for u in report.kept_units]
      ([[0, 2], [0, 1, 2]], [192, 192])
      >>> report.head_masks[0]  # block 0's kept heads
      ((Causal() & Local(left=1, right=0)), Causal())
      >>> report.kept_candidates[0].astype(int).tolist()  # bool [N, C], every head
      [[1, 0], [1, 0], [0, 1]]
      >>> report.threshold, report.price, report.density  # mean of 15/64 (x3), 36/64 (x2)
      (None, 'density', 0.365625)
    """

    kept_heads: tuple[np.ndarray, ...]  # per block: indices of the heads that stay
    kept_units: tuple[np.ndarray, ...]  # per block: indices of the FFN units that stay
    head_masks: tuple[tuple[masks_lib.Mask, ...] | None, ...]  # per block: kept heads' masks
    kept_candidates: tuple[np.ndarray | None, ...]  # per block: bool [N, C] kept candidates
    # The candidate threshold used: None for each layer's default (no budget) or when a budget
    # moved heads to cheaper candidates; inf when only each head's strongest candidate fits.
    threshold: float | None
    density: float  # mean density of the kept heads' masks at the reference length
    price: str = "density"  # what `budget` counted: "density" or "blocks"
    cost: float = 0.0  # the kept heads' mean cost in `price` at the reference length
    # Per block: the data-dependent candidates (BlockSelections) of the layer, and bool
    # [kept heads, selections], which of them each kept head adds to its mask (None: no heads).
    selections: tuple[tuple, ...] = ()
    head_selections: tuple[np.ndarray | None, ...] = ()


def _gate_values(gate: Gate | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(keep mask [n], value to fold [n]) of a gate (no gate: keep all, value 1)."""
    if gate is None or gate.kind == "score_scaling":
        return np.ones(n, bool), np.ones(n, np.float32)
    hard = np.asarray(gate.hard_values()) > 0
    value = np.asarray(gate.values(), np.float32)
    return hard, np.where(hard, value, 0.0)


def _kept_per_block(blocks, weights_of, choose):
    """Kept-candidate matrices, one per block: ``choose(weights [N, C], block) -> bool [N, C]``
    where the block learns candidate weights, None elsewhere."""
    return [None if (w := weights_of(b)) is None else choose(w, b) for b in blocks]


def _candidate_costs(block, n_ref: int, price: str) -> np.ndarray:
    """float64 ``[C]``: each candidate's cost in ``price`` at ``n_ref``."""
    core = block.attn.core
    return core.block_costs(n_ref) if price == "blocks" else core.candidate_densities(n_ref)


def _cheapest(blocks, weights_of, n_ref, price):
    """Kept matrices with every head on its cheapest candidate."""

    def choose(w, block):
        cost = _candidate_costs(block, n_ref, price)
        kept = np.zeros(w.shape, bool)
        kept[:, cost.argmin()] = True
        return kept

    return _kept_per_block(blocks, weights_of, choose)


def _downgrade(blocks, kept_by_block, weights_of, assemble, budget, n_ref, price):
    """Greedy fallback when no threshold meets ``budget``: starting from each head's strongest
    candidate, repeatedly move the costliest head to its strongest *cheaper* candidate until the
    mean cost fits (None if it never does)."""
    kept_by_block = [None if k is None else k.copy() for k in kept_by_block]
    cand_cost = [
        None if weights_of(b) is None else _candidate_costs(b, n_ref, price) for b in blocks
    ]
    while True:
        plan = assemble(kept_by_block)
        if plan[4] <= budget:
            return plan
        best = None  # (cost, block, head, new candidate)
        for i, (kept, cost) in enumerate(zip(kept_by_block, cand_cost, strict=True)):
            if kept is None:
                continue
            w = weights_of(blocks[i])
            for h in range(kept.shape[0]):
                current = cost[kept[h]].max()
                cheaper = np.flatnonzero(cost < current)
                if cheaper.size and (best is None or current > best[0]):
                    best = (current, i, h, cheaper[np.argmax(w[h, cheaper])])
        if best is None:
            return None
        _, i, h, c = best
        kept_by_block[i][h] = False
        kept_by_block[i][h, c] = True


def harden_plan(
    model: GPT2,
    *,
    threshold: float | None = None,
    budget: float | None = None,
    length=None,
    price: str = "density",
) -> HardenReport:
    """Decides what :func:`harden` keeps (see there for the arguments).

    Per block of ``N`` heads and ``C`` candidates, the report holds the kept heads and FFN
    units (index arrays), the kept heads' masks and the kept candidates (bool ``[N, C]``).

    Example:
      >>> from sparse_jax.masks import causal, local, sink
      >>> from sparse_jax.models.gpt2 import GPT2Config
      >>> cands = (sink(2) & causal(), causal() & local(3, 0), causal())
      >>> spec = AttentionSpec(kind="candidates", candidates=cands, granularity="head")
      >>> student = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))  # 3 heads a block
      >>> for block in student.h:  # logits [N, C]: weights sigmoid(2, 1, -1) = 0.88, 0.73, 0.27
      ...     block.attn.core.logits[...] = jnp.array([[2.0, 1.0, -1.0]] * 3)
      >>> plan = harden_plan(student, length=8)  # weight >= 0.5: the sink and the window
      >>> plan.kept_candidates[0].astype(int).tolist(), plan.density  # [N, C]; density at 8
      ([[1, 1, 0], [1, 1, 0], [1, 1, 0]], 0.515625)
      >>> plan = harden_plan(student, budget=0.3, length=8)  # the lowest threshold that fits
      >>> round(plan.threshold, 3), plan.density, plan.kept_candidates[0][0].tolist()
      (0.881, 0.234375, [True, False, False])
    """
    caller = "harden"
    check_choice(price, "price", ("density", "blocks"), caller)
    if not isinstance(model, GPT2):
        raise TypeError(f"{caller}: `model` must be a sparse_jax GPT2; got {type(model).__name__}")
    if threshold is not None and budget is not None:
        raise ValueError(f"{caller}: pass `threshold` or `budget`, not both")
    if threshold is not None and not (isinstance(threshold, numbers.Real) and 0 < threshold < 1):
        raise ValueError(f"{caller}: `threshold` must be in (0, 1); got {threshold!r}")
    if budget is not None and not (isinstance(budget, numbers.Real) and 0 < budget <= 1):
        what = "mean block cost" if price == "blocks" else "mean attention density"
        raise ValueError(f"{caller}: `budget` ({what}) must be in (0, 1]; got {budget!r}")
    n_ref = model.config.n_positions if length is None else check_int(length, "length", caller)
    blocks = list(model.h)
    block_sizes = [spec.block_size for spec in model.specs]

    def weights_of(block) -> np.ndarray | None:
        core = block.attn.core if block.attn.num_heads else None
        if isinstance(core, CandidateMaskAttention):
            return np.asarray(core.candidate_weights(per_head=True))  # [N, C]
        return None

    def assemble(kept_by_block):
        """The plan for explicit kept-candidate matrices (None for blocks without them)."""
        heads, units, head_masks, densities, costs = [], [], [], [], []
        selections, head_selections = [], []
        for block, kept, block_size in zip(blocks, kept_by_block, block_sizes, strict=True):
            attn = block.attn
            n = attn.num_heads
            keep_h, _ = _gate_values(attn.head_gate, n)
            heads.append(np.flatnonzero(keep_h))
            u = block.mlp.units
            keep_u, _ = _gate_values(block.mlp.gate, u) if u else (np.ones(0, bool), None)
            units.append(np.flatnonzero(keep_u))
            if not n:
                head_masks.append(None)
                selections.append(())
                head_selections.append(None)
                continue
            masks, sels, picks = _head_parts(attn.core, kept)
            head_masks.append(tuple(masks[h] for h in heads[-1]))
            selections.append(sels)
            head_selections.append(picks[heads[-1]])
            for h in heads[-1]:
                chosen = [s for s, on in zip(sels, picks[h], strict=True) if on]
                if not chosen:
                    densities.append(mask_density(masks[h], n_ref))
                    if price == "blocks":
                        costs.append(mask_block_cost(masks[h], n_ref, block_size))
                    continue
                # A selection's blocks counted as if nothing else covered them: upper bounds.
                densities.append(union_density_bound(masks[h], chosen, n_ref))
                if price == "blocks":
                    own = 0.0 if masks[h] == SELF else mask_block_cost(masks[h], n_ref, block_size)
                    extra = sum(selection_block_cost(s, n_ref, block_size) for s in chosen)
                    costs.append(min(1.0, own + extra))
        density = float(np.mean(densities)) if densities else 0.0
        cost = (float(np.mean(costs)) if costs else 0.0) if price == "blocks" else density
        return (
            heads, units, head_masks, list(kept_by_block), cost, density, selections,
            head_selections,
        )  # fmt: skip

    def kept_at(t: float | None):
        def choose(w, block):  # weight >= t, and each head's strongest (never an empty head)
            return np.array(block.attn.core.kept_candidates(t))

        return _kept_per_block(blocks, weights_of, choose)

    if budget is None:  # None: each layer's default (0.5 for sigmoid weights, else the support)
        t = None if threshold is None else float(threshold)
        plan = assemble(kept_at(t))
    else:  # the lowest threshold (most candidates kept) whose density fits the budget
        weights = sorted(
            {float(x) for b in blocks if (w := weights_of(b)) is not None for x in w.ravel()}
        )
        t, plan = None, None
        for cand in [*weights, float("inf")]:  # inf: each head keeps only its strongest
            trial = assemble(kept_at(cand))
            if trial[4] <= budget:
                t, plan = cand, trial
                break
        if plan is None:
            strongest = kept_at(float("inf"))
            plan = _downgrade(blocks, strongest, weights_of, assemble, budget, n_ref, price)
        if plan is None:
            floor = assemble(_cheapest(blocks, weights_of, n_ref, price))[4]
            what = "block cost" if price == "blocks" else "density"
            raise ValueError(
                f"{caller}: `budget`={budget} cannot be met: every head on its cheapest "
                f"candidate still gives mean {what} {floor:.3f}"
            )
    heads, units, head_masks, kept_cands, cost, density, selections, head_selections = plan
    return HardenReport(
        tuple(heads),
        tuple(units),
        tuple(head_masks),
        tuple(kept_cands),
        t,
        density,
        price,
        cost,
        tuple(selections),
        tuple(head_selections),
    )


def _head_parts(core, kept) -> tuple[tuple[masks_lib.Mask, ...], tuple, np.ndarray]:
    """A layer's heads as (static masks, its selections, bool [N, selections] kept)."""
    if isinstance(core, CandidateMaskAttention):
        masks, picks = core.head_parts(kept)
        return masks, tuple(core.candidates[i] for i in core.selection_indices), picks
    picks = np.asarray(core.selected, bool).reshape(core.num_heads, len(core.selections))
    return core.head_masks(), core.selections, picks


def harden(
    model: GPT2,
    *,
    threshold: float | None = None,
    budget: float | None = None,
    length: int | None = None,
    impl: str = "auto",
    price: str = "density",
) -> GPT2:
    """A fixed sparse GPT-2 that keeps what ``model`` learned (see the module docstring).

    Args:
      model: a trained :class:`~sparse_jax.models.gpt2.GPT2` student (any attention kinds).
      threshold: keep candidate ``c`` of a head when its weight is ``>= threshold``; default:
        each layer's own (0.5 for sigmoid weights; the support, weight > 0, for sparsemax or
        entmax15 weights: exact, since the others are exactly 0).
      budget: instead of a threshold, the largest mean cost (over kept heads, at ``length``;
        attention density, or block cost with ``price="blocks"``) allowed: the lowest threshold
        that meets it is used; when even each head's strongest candidate alone exceeds it, the
        costliest heads move, one at a time, to their strongest cheaper candidate until it fits
        (ValueError if the cheapest cannot).
      length: sequence length at which densities and costs are measured (default
        ``n_positions``; the serving length).
      impl: attention implementation of the hardened blocks (``"auto"``: block-sparse when
        the mask leaves enough out). On the block-sparse engine each head runs at the blocks
        its mask wants at ``n_positions`` (:func:`~sparse_jax.models.flops.serving_block_size`
        among its own ``block_size`` and 32 to 128: a window at small blocks, full causal at
        large ones; ``FixedAttention``'s
        ``head_block_sizes``); other engines, and the prices, use the layer's ``block_size``.
      price: what ``budget`` bounds: ``"density"`` (the mean density) or ``"blocks"`` (the
        mean block cost: the score entries the block-sparse kernel forms with each block's
        ``block_size``, relative to causal attention's; see
        :func:`~sparse_jax.models.flops.mask_block_cost`), in which a pattern that touches every
        block costs what causal costs.

    Returns:
      A new :class:`GPT2` with ``heads_per_layer``/``inner_per_layer`` set and fixed masks
      (like ``model``, it maps ids ``[B, T]`` to logits ``[B, T, V]``).

    Example:
      >>> from sparse_jax.masks import causal, local, sink
      >>> from sparse_jax.models.gpt2 import GPT2Config
      >>> cands = (sink(2) & causal(), causal() & local(3, 0), causal())
      >>> spec = AttentionSpec(kind="candidates", candidates=cands, granularity="head")
      >>> student = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))
      >>> for block in student.h:  # candidate weights sigmoid(2, 1, -1) = 0.88, 0.73, 0.27
      ...     block.attn.core.logits[...] = jnp.array([[2.0, 1.0, -1.0]] * 3)
      >>> hard = harden(student)  # keeps weights >= 0.5: the union of the sink and the window
      >>> hard.config.heads_per_layer, hard.h[0].attn.core.mask
      ((3, 3), ((Sink(n=2) & Causal()) | (Causal() & Local(left=3, right=0))))
      >>> float(hard.attention_density(8))
      0.515625
    """
    plan = harden_plan(model, threshold=threshold, budget=budget, length=length, price=price)
    cfg = model.config
    config = dataclasses.replace(
        cfg,
        heads_per_layer=tuple(len(h) for h in plan.kept_heads),
        inner_per_layer=tuple(len(u) for u in plan.kept_units),
    )
    specs = []
    for i, spec in enumerate(model.specs):
        masks = plan.head_masks[i]
        if not masks:
            mask = None
        elif all(m == masks[0] for m in masks):
            mask = masks[0]
        else:
            mask = masks_lib.per_head(list(masks))
        learn_alpha = spec.learn_alpha and spec.kind == "fixed"
        picks = plan.head_selections[i]
        used = [] if picks is None else [j for j in range(picks.shape[1]) if picks[:, j].any()]
        specs.append(
            AttentionSpec(
                kind="fixed",
                mask=mask,
                normalizer=spec.normalizer,
                learn_alpha=learn_alpha,
                impl="xla" if used else impl,
                block_size=spec.block_size,
                selections=tuple(plan.selections[i][j] for j in used),
                selected=tuple(map(tuple, picks[:, used].tolist())) if used else None,
                head_block_sizes=(
                    tuple(serving_block_size(m, cfg.n_positions, spec.block_size) for m in masks)
                    if masks
                    else None
                ),
            )
        )
    hard = GPT2(config, specs, rngs=nnx.Rngs(0))
    _copy_weights(model, hard, plan)
    return hard


def _copy_selector_gates(src_core, dst_core, picks: np.ndarray | None, keep) -> None:
    """The kept heads' maps of each learned selector the hardened layer keeps
    (:class:`~sparse_jax.block_gate.LearnedBlockSelection`): hardened selection ``p`` is the
    ``p``-th of the source's selections that a kept head uses, whose gate the source holds
    under its candidate index (a candidates layer) or selection index (a fixed layer)."""
    if picks is None or dst_core.selector_gates is None:
        return
    used = [j for j in range(picks.shape[1]) if picks[:, j].any()]
    if isinstance(src_core, CandidateMaskAttention):
        sources = src_core.selection_indices
    else:
        sources = tuple(range(len(src_core.selections)))
    for p, j in enumerate(used):
        if str(p) in dst_core.selector_gates:
            src_gate = src_core.selector_gates[str(sources[j])]
            dst_gate = dst_core.selector_gates[str(p)]
            dst_gate.w_q[...] = src_gate.w_q[...][np.asarray(keep)]
            dst_gate.w_k[...] = src_gate.w_k[...][np.asarray(keep)]


def _copy_weights(src: GPT2, dst: GPT2, plan: HardenReport) -> None:
    """Copies ``src``'s weights into the smaller ``dst``, selecting kept heads/units and folding
    gate values."""
    cfg = src.config
    h = cfg.head_dim
    dst.wte.embedding[...] = src.wte.embedding[...]
    if src.wpe is not None:  # (rotary positions have no table)
        dst.wpe.embedding[...] = src.wpe.embedding[...]
    for name in ("scale", "bias"):
        getattr(dst.ln_f, name)[...] = getattr(src.ln_f, name)[...]
    for i, (sb, db) in enumerate(zip(src.h, dst.h, strict=True)):
        for ln in ("ln_1", "ln_2"):
            for name in ("scale", "bias"):
                getattr(getattr(db, ln), name)[...] = getattr(getattr(sb, ln), name)[...]
        # Attention: select kept heads of q, k, v and of the output projection.
        sa, da = sb.attn, db.attn
        keep = plan.kept_heads[i]
        if sa.num_heads and len(keep):
            n = sa.num_heads
            _, fold = _gate_values(sa.head_gate, n)
            kernel = sa.c_attn.kernel[...].reshape(-1, 3, n, h)
            bias = sa.c_attn.bias[...].reshape(3, n, h)
            if sa.head_gate is not None and sa.head_gate.kind == "score_scaling":
                s = jnp.asarray(sa.head_gate.values())[:, None]
                kernel = kernel.at[:, 0].multiply(s)
                bias = bias.at[0].multiply(s)
            da.c_attn.kernel[...] = kernel[:, :, keep].reshape(kernel.shape[0], -1)
            da.c_attn.bias[...] = bias[:, keep].reshape(-1)
            proj = sa.c_proj.kernel[...].reshape(n, h, -1) * jnp.asarray(fold)[:, None, None]
            da.c_proj.kernel[...] = proj[keep].reshape(len(keep) * h, -1)
            da.c_proj.bias[...] = sa.c_proj.bias[...]
            if da.core.alpha_logit is not None and sa.core.alpha_logit is not None:
                da.core.alpha_logit[...] = sa.core.alpha_logit[...][keep]
            if sa.smear_logit is not None:
                da.smear_logit[...] = sa.smear_logit[...][keep]
            _copy_selector_gates(sa.core, da.core, plan.head_selections[i], keep)
        elif sa.num_heads:  # every head pruned: only the projection's bias remains
            da.c_proj_bias[...] = sa.c_proj.bias[...]
        else:
            da.c_proj_bias[...] = sa.c_proj_bias[...]
        # FFN units.
        sm, dm = sb.mlp, db.mlp
        keep = plan.kept_units[i]
        if sm.units and len(keep):
            _, fold = _gate_values(sm.gate, sm.units)
            dm.c_fc.kernel[...] = sm.c_fc.kernel[...][:, keep]
            dm.c_fc.bias[...] = sm.c_fc.bias[...][keep]
            dm.c_proj.kernel[...] = (sm.c_proj.kernel[...] * jnp.asarray(fold)[:, None])[keep]
            dm.c_proj.bias[...] = sm.c_proj.bias[...]
        elif sm.units:
            dm.c_proj_bias[...] = sm.c_proj.bias[...]
        else:
            dm.c_proj_bias[...] = sm.c_proj_bias[...]
