"""``python -m experiments.bench search_passes``: how many threshold-search passes the fused
kernels' sparse normalizers take per query tile, on random scores and on the bundled teacher's
own attention scores (see SearchPassesConfig). Counted, not timed: runs anywhere."""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import timing

# Positions of the bundled teacher (experiments/distill/teachers/default/config.json): the
# longest rows its scores have (checked against the model when it is loaded).
TEACHER_POSITIONS = 512


@dataclasses.dataclass(frozen=True)
class SearchPassesConfig:
    """How many passes over a row's blocks the fused kernels' threshold searches take (as they
    run them: ``smallest=True``, done in the pass that reaches the threshold), from -1 and
    from the kernels' start (``normalizers.sparsemax_start``, ``entmax15_start`` on the
    values the first pass keeps: each block's ``block_top`` largest of a row, the ``top``
    largest of those, merged by the kernel's own code), on query tiles of random scores or of
    the bundled teacher's causal attention scores (``--scores teacher``: the distribution over
    its tiles, per layer): each pass recomputes the tile's scores over every kept block, so the
    count is the sparse forward's cost in units of a pass. Hardware-independent (counted, not
    timed): runs anywhere.

    Example::

        python -m experiments.bench search_passes --scores teacher --lengths 512
    """

    lengths: tuple[int, ...] = (640, 4096, 16384)
    """Row lengths (keys a query row keeps: 640 is causal & local(512, 0) at blocks of 128),
    multiples of ``block``."""
    scales: tuple[float, ...] = (1.0, 2.0, 4.0)
    """Standard deviations of the scores (1: q·k/√d of unit-variance q and k)."""
    normalizers: tuple[Literal["sparsemax", "entmax15"], ...] = ("sparsemax", "entmax15")
    rows: int = 64
    """Rows of a query tile (the kernels' default tiles): the tile's search runs until its
    last row is done."""
    block: int = 64
    """Keys per block (the kernels' default tiles)."""
    top: int | None = None
    """Values per row the start uses; default the kernels' for each normalizer
    (``kernels.tilemath.START_TOP``)."""
    block_top: int | None = None
    """Largest values of each block the first pass keeps; default the kernels'
    (``kernels.tilemath.BLOCK_TOP``); 0: the row's own ``top`` largest."""
    seed: int = 0
    """Seed of the Gaussian scores."""
    scores: Literal["gaussian", "teacher"] = "gaussian"
    """Where the scores come from: ``gaussian``, random N(0, std²) rows of full length (one
    tile per length and std); ``teacher``, the bundled teacher's causal attention scores q·k/√d
    (every layer and head) on the first ``windows`` windows of ``n`` tokens of the embedded
    evaluation text, each query tile's rows over its kept key blocks, the future keys masked
    (-inf) as the kernels mask them; ``lengths`` at most the teacher's 512 positions and
    multiples of ``rows``; ``scales`` and ``seed`` unused."""
    windows: int = 4
    """Evaluation windows the teacher scores come from (``--scores teacher``)."""
    output: pathlib.Path | None = None
    """Also write the markdown to this file."""

    def __post_init__(self) -> None:
        timing.check_counts(self, "rows", "block", "windows")
        timing.check_count_tuples(self, "lengths")
        if self.scores not in ("gaussian", "teacher"):
            raise ValueError(f"scores must be 'gaussian' or 'teacher', got {self.scores!r}")
        if self.scores == "teacher":
            bad = [n for n in self.lengths if n > TEACHER_POSITIONS or n % self.block]
            if bad:
                raise ValueError(
                    f"lengths {bad} with --scores teacher: each must be at most the teacher's "
                    f"{TEACHER_POSITIONS} positions and a multiple of block {self.block}"
                )
            bad = [n for n in self.lengths if n % self.rows]
            if bad:
                raise ValueError(
                    f"lengths {bad} with --scores teacher: each must be a multiple of rows "
                    f"{self.rows} (whole query tiles)"
                )
        if self.top is not None:
            timing.check_counts(self, "top")
        if self.block_top is not None and (isinstance(self.block_top, bool) or self.block_top < 0):
            raise ValueError(f"block_top must be an int >= 0, got {self.block_top!r}")
        if any(n % self.block for n in self.lengths):
            raise ValueError(f"lengths {self.lengths} must be multiples of block {self.block}")
        if not self.scales or any(not (s > 0 and s < float("inf")) for s in self.scales):
            raise ValueError(f"scales must be finite and > 0, got {self.scales!r}")


def start_values(z, top: int, block_top: int, block: int) -> list:
    """The values the kernels' first pass keeps of rows ``z [rows, n]``: each ``block``-key
    block's ``block_top`` largest, the ``top`` largest of those (``[rows, 1]`` each,
    decreasing; -inf where fewer), by the kernels' own ``tile_top`` and ``insert_top``;
    ``block_top`` 0: the rows' own ``top`` largest."""
    from sparse_jax.kernels import tilemath

    if block_top == 0:
        ordered = -jnp.sort(-z, axis=-1)
        return [ordered[:, i : i + 1] for i in range(min(top, z.shape[-1]))]
    kept = (jnp.full((z.shape[0], 1), -jnp.inf, z.dtype),) * top
    for start in range(0, z.shape[-1], block):
        for value in tilemath.tile_top(z[:, start : start + block], block_top):
            kept = tilemath.insert_top(kept, value)
    return list(kept)


def sorted_threshold(normalizer: str, z) -> np.ndarray:
    """Each row's threshold τ ``[rows, 1]`` by sorting, in float64: of sparsemax (``z = x -
    max``: the closed form on the largest support that fits) or 1.5-entmax (``z = (x - max) /
    2``: the root of ``Σ [z - τ]_+² = 1`` on the largest k whose root stays below its k-th
    value). The reference the searches are checked and counted against."""
    s = -np.sort(-np.asarray(z, np.float64), axis=-1)
    k = np.arange(1, s.shape[-1] + 1)
    with np.errstate(invalid="ignore"):
        s1 = np.cumsum(s, axis=-1)
        if normalizer == "sparsemax":
            support = (1.0 + k * s > s1).sum(-1, keepdims=True)
            return (np.take_along_axis(s1, support - 1, axis=-1) - 1.0) / support
        disc = s1 * s1 - k * (np.cumsum(s * s, axis=-1) - 1.0)
        roots = (s1 - np.sqrt(np.maximum(disc, 0.0))) / k
        fits = (disc >= 0) & (roots <= s)
    last = np.where(fits, k, 0).max(-1, keepdims=True)
    return np.take_along_axis(roots, last - 1, axis=-1)


def count_passes(search, z) -> tuple[int, np.ndarray, jax.Array]:
    """Runs a ``normalizers.RowSearch`` on whole rows ``z [rows, n]``: (passes until every row
    is done, each row's passes ``[rows]``, the final τ ``[rows, 1]``)."""
    state, passes = search.init, 0
    per_row = np.zeros(z.shape[0], int)
    while not bool(jnp.all(state[-1])) and passes < search.max_iter:
        terms = search.terms(z, state)
        sums = tuple(
            (jnp.min if i >= len(terms) - search.minima else jnp.sum)(t, axis=-1, keepdims=True)
            for i, t in enumerate(terms)
        )
        state, passes = search.update(state, sums), passes + 1
        per_row += ~np.asarray(state[-1])[:, 0]
    return passes, per_row + 1, state[0]


def _searches(normalizer: str, z, top: int, block_top: int, block: int) -> list:
    """The kernels' searches (``smallest=True``) of rows ``z [rows, n]`` from -1 and from the
    kernels' start on the values their first pass keeps (:func:`start_values`)."""
    from sparse_jax import normalizers as nz

    kept = start_values(z, top, block_top, block)
    done = jnp.zeros((z.shape[0], 1), bool)
    minus_one = jnp.full((z.shape[0], 1), -1.0)
    if normalizer == "sparsemax":
        starts = (minus_one, nz.sparsemax_start(kept))
        return [nz.sparsemax_search(tau0, done, z.shape[-1], smallest=True) for tau0 in starts]
    starts = (minus_one, nz.entmax15_start(kept))
    return [nz.entmax15_search(tau0, done, smallest=True) for tau0 in starts]


def search_variable(normalizer: str, x) -> jax.Array:
    """The searches' variable of score rows ``x [rows, n]`` (-inf where masked), float32: ``x -
    max`` (sparsemax) or ``(x - max) / 2`` (1.5-entmax), formed in float64 as the Gaussian
    rows are (the kernels form it in float32)."""
    x = np.asarray(x, np.float64)
    z = x - x.max(-1, keepdims=True)
    return jnp.asarray(z if normalizer == "sparsemax" else z / 2, jnp.float32)


class TilePasses(NamedTuple):
    """Passes of query tiles from one start (:func:`tile_passes`)."""

    tiles: np.ndarray
    """``[tiles]``: passes until the tile's last row is done."""
    rows: np.ndarray
    """``[tiles * rows]``: each row's passes."""
    ulps: float
    """Largest difference of the rows' τ to sorting's, in float32 eps (their maximum is 0)."""
    support: np.ndarray
    """``[tiles * rows]``: each row's support at its τ (the keys above it)."""


def tile_passes(
    normalizer: str, x, rows: int, top: int, block_top: int, block: int
) -> tuple[TilePasses, TilePasses]:
    """The kernels' search passes (from -1, from their start) of query tiles: score rows ``x
    [tiles * rows, n]`` (-inf where masked: a causal row's future keys), each run of ``rows``
    consecutive rows one tile, its keys in ``block``-key blocks.

    All tiles are searched at once: each row's search runs on its own (a done row keeps its
    τ), so a tile's count is its rows' largest, capped at the search's ``max_iter`` as
    :func:`count_passes` caps it; -inf entries (a tile's masked keys, or keys past its last
    kept block) are outside every support and add nothing to a pass' sums, as in the kernels.

    Example:
      >>> x = np.where(np.tri(8, dtype=bool), np.random.default_rng(0).normal(size=(8, 8)),
      ...              -np.inf)  # causal rows: two 4-row tiles, blocks of 4 keys
      >>> base, ours = tile_passes("sparsemax", x, 4, top=16, block_top=2, block=4)
      >>> base.tiles.shape, ours.rows.shape, bool((ours.tiles <= base.tiles).all())
      ((2,), (8,), True)
    """
    if x.shape[0] % rows:
        raise ValueError(f"x has {x.shape[0]} rows, not a multiple of rows {rows}")
    z = search_variable(normalizer, x)
    reference = sorted_threshold(normalizer, z)
    out = []
    for search in _searches(normalizer, z, top, block_top, block):
        _, per_row, tau = count_passes(search, z)
        tiles = np.minimum(per_row.reshape(-1, rows).max(-1), search.max_iter)
        ulps = np.abs(np.asarray(tau, np.float64) - reference).max() / np.finfo(np.float32).eps
        support = np.asarray(jnp.sum(z > tau, axis=-1))
        out.append(TilePasses(tiles, per_row, float(ulps), support))
    return out[0], out[1]


def evaluation_windows(n: int, count: int) -> np.ndarray:
    """The first ``count`` windows of ``n`` tokens of the embedded evaluation text (CPython's
    ``pydoc_data.topics``, byte tokens), int32 ``[count, n]``: the inputs ``w[:-1]`` of the
    main job's evaluation windows at ``--data.seq-len n`` (``text.prepare("default", "byte",
    n)``'s eval split), tokenized here without writing its dataset.

    Example:
      >>> evaluation_windows(128, 2).shape
      (2, 128)
    """
    from sparse_jax.data import text
    from sparse_jax.data.tokenizers import get_tokenizer

    documents = text.resolve_source("default").documents("eval")
    windows = text.make_windows(text.token_stream(documents, get_tokenizer("byte")), n)
    if len(windows) < count:
        raise ValueError(
            f"windows {count}: the embedded evaluation text holds {len(windows)} windows of "
            f"{n} tokens (and the next); pass at most that many"
        )
    return np.asarray(windows[:count, :-1], np.int32)


def teacher_scores(ids) -> np.ndarray:
    """The bundled teacher's causal attention scores q·k/√d on token windows ``ids [W, n]``,
    float32 ``[L, W, N, n, n]`` (layers, windows, heads, queries, keys), -inf on future keys:
    each block's queries and keys by its own projection (``SelfAttention.project_qkv``: keys
    smeared and positions rotated where the model has them, as the bundled teacher has)
    of its normalized input, the blocks run in float32.

    Example:
      >>> teacher_scores(evaluation_windows(64, 1)).shape
      (4, 1, 4, 64, 64)
    """
    from experiments.common import teachers
    from sparse_jax.models import from_pretrained

    model = from_pretrained(teachers.BUNDLED)
    if model.config.n_positions != TEACHER_POSITIONS:
        raise ValueError(
            f"the bundled teacher has {model.config.n_positions} positions, the benchmark "
            f"expects TEACHER_POSITIONS = {TEACHER_POSITIONS}: update it"
        )
    ids = jnp.asarray(ids)
    n = ids.shape[1]
    positions = jnp.arange(n)
    future = ~np.tri(n, dtype=bool)
    x = model.embed(ids, positions).astype(jnp.float32)
    out = []
    for block in model.h:
        attn = block.attn
        q, k, _ = attn.project_qkv(block.ln_1(x), positions)
        scores = jnp.einsum("bqnh,bknh->bnqk", q.astype(jnp.float32), k.astype(jnp.float32))
        out.append(np.where(future, -np.inf, np.asarray(scores / attn.head_dim**0.5)))
        x = block(x, positions)[0].astype(jnp.float32)
    return np.stack(out).astype(np.float32)


# Bins of the passes a tile takes in the teacher table: (label, least, most).
PASS_BINS = (("1", 1, 1), ("2", 2, 2), ("3", 3, 3), ("4", 4, 4), ("5–7", 5, 7), ("≥ 8", 8, None))


def _teacher_search_passes(config: SearchPassesConfig, block_top: int) -> tuple[str, list[str]]:
    """The table and notes of ``--scores teacher`` (see SearchPassesConfig)."""
    from experiments.common import teachers
    from sparse_jax.kernels import tilemath

    rows = []
    for n in config.lengths:
        timing.log(f"teacher scores at n = {n} on {config.windows} windows ...")
        scores = teacher_scores(evaluation_windows(n, config.windows))
        n_layer, n_head = scores.shape[0], scores.shape[2]
        with np.errstate(invalid="ignore"):  # (a row's std, -inf keys as NaN: nanstd)
            row_std = np.nanstd(np.where(np.isfinite(scores), scores, np.nan), axis=-1)[..., 1:]
        for norm in config.normalizers:
            top = config.top or tilemath.START_TOP[norm]
            timing.log(f"  {norm}: counting passes of {n_layer} layers ...")
            layers = [
                tile_passes(norm, s.reshape(-1, n), config.rows, top, block_top, config.block)
                for s in scores
            ]
            for layer in ["all", *range(n_layer)]:
                chosen = list(range(n_layer)) if layer == "all" else [layer]
                std = float(row_std[chosen].mean())
                support = np.concatenate([layers[j][1].support for j in chosen]).mean()
                for i, start in enumerate(["-1", f"kernels' ({top})"]):
                    tiles = np.concatenate([layers[j][i].tiles for j in chosen])
                    per_row = np.concatenate([layers[j][i].rows for j in chosen])
                    ulps = max(layers[j][i].ulps for j in chosen)
                    shares = [
                        np.mean((tiles >= lo) & (tiles <= (hi or tiles.max())))
                        for _, lo, hi in PASS_BINS
                    ]
                    rows.append(
                        [norm, str(n), str(layer), str(tiles.size), f"{std:.1f}",
                         f"{support:.2f}", start, *(f"{100 * share:.0f}%" for share in shares),
                         f"{tiles.mean():.2f}", str(tiles.max()), f"{per_row.mean():.2f}",
                         f"{ulps:.2f}"]
                    )  # fmt: skip
    headers = ["normalizer", "n", "layer", "tiles", "row score std", "support", "start",
               *(f"{label} pass{'es' if label != '1' else ''}" for label, _, _ in PASS_BINS),
               "tile mean", "tile max", "row mean", "ulps from sorting"]  # fmt: skip
    table = timing.markdown_table(headers, rows, align="lrrrrrl" + "r" * (len(PASS_BINS) + 4))
    trained = teachers.record()["flags"]["data.seq_len"]
    notes = [
        f"Scores: the bundled teacher's (experiments/distill/teachers/default: GPT-2 of "
        f"{n_layer} blocks of {n_head} heads, trained on {trained}-token windows) causal "
        f"attention scores q·k/√d, every layer and head, on the first {config.windows} windows "
        "of n tokens of the embedded evaluation text (pydoc_data.topics, byte tokens: the main "
        f"job's evaluation split); query tiles of {config.rows} rows over their kept "
        f"{config.block}-key blocks (causal: the blocks up to the diagonal), future keys "
        "masked (-inf) as the kernels mask them. layer all: every layer's tiles pooled. "
        "Passes columns: the share of tiles whose search takes that many passes; tile mean, "
        "tile max: of the tiles' passes; row mean: of each row's own passes. row score std: "
        "the mean over query rows of the standard deviation of a row's unmasked scores (the "
        "Gaussian table's score std); support: the mean keys per row above τ. ulps from "
        "sorting: the largest difference of that start's threshold to sorting's in float64, "
        "in float32 eps (the rows' maximum is 0).",
    ]
    return table, notes


_PASSES_NOTE = (
    ". Passes: threshold-search passes until the tile's last row (or the row) is done, the "
    "confirming pass included (and 1.5-entmax's polishing pass where a root was formed far "
    "from it); the kernels add a first pass (the maximum and the largest values) and an output "
    "pass."
)


def _start_note(config: SearchPassesConfig, block_top: int) -> str:
    return "the start uses " + (
        "each row's largest values (start values: how many)"
        if block_top == 0
        else f"the largest (start values: how many) of each {config.block}-key block's "
        f"{block_top} largest values of a row, as the kernels' first pass keeps them"
    )


def run_search_passes(config: SearchPassesConfig, command: str) -> str:
    """Returns the markdown of the search-passes count (see SearchPassesConfig)."""
    from sparse_jax.kernels import tilemath

    block_top = tilemath.BLOCK_TOP if config.block_top is None else config.block_top
    start = time.perf_counter()
    header = timing.environment_line(command)
    if config.scores == "teacher":
        table, notes = _teacher_search_passes(config, block_top)
        start_note = _start_note(config, block_top).replace(
            "start values: how many", "start: how many"
        )
        notes.append("The " + start_note[4:] + _PASSES_NOTE)
        notes.append(f"Total wall time {time.perf_counter() - start:.0f} s.")
        return "\n".join([header, "", table, "", *(f"- {note}" for note in notes)]) + "\n"
    rng = np.random.default_rng(config.seed)
    rows = []
    for norm in config.normalizers:
        for n in config.lengths:
            for scale in config.scales:
                x = rng.standard_normal((config.rows, n)) * scale
                z = x - x.max(-1, keepdims=True)
                z = jnp.asarray(z if norm == "sparsemax" else z / 2, jnp.float32)
                top = config.top or tilemath.START_TOP[norm]
                searches = _searches(norm, z, top, block_top, config.block)
                (base, base_rows, tau), (ours, our_rows, tau_ours) = (
                    count_passes(search, z) for search in searches
                )
                gap = float(jnp.max(jnp.abs(tau - tau_ours)))
                ulps = np.abs(np.asarray(tau_ours, np.float64) - sorted_threshold(norm, z))
                ulps = float(ulps.max()) / float(np.finfo(np.float32).eps)
                rows.append(
                    [norm, str(n), f"{scale:g}", str(top), str(base), str(ours),
                     f"{base_rows.mean():.1f}", f"{our_rows.mean():.1f}", f"{gap:.1e}",
                     f"{ulps:.2f}"]
                )  # fmt: skip
    headers = ["normalizer", "n", "score std", "start values", "tile passes from -1",
               "from the start", "row mean from -1", "from the start", "max |Δτ|",
               "ulps from sorting"]  # fmt: skip
    table = timing.markdown_table(headers, rows, align="lrrrrrrrrr")
    notes = [
        f"{config.rows}-row tiles of N(0, std²) scores; "
        + _start_note(config, block_top)
        + _PASSES_NOTE
        + " max |Δτ|: the two starts' thresholds (the same τ, to rounding); ulps from sorting: "
        "the largest difference of the threshold from the start to sorting's in float64, in "
        "float32 ulps (eps) of the rows' scale (their maximum is 0).",
        f"Total wall time {time.perf_counter() - start:.0f} s.",
    ]
    return "\n".join([header, "", table, "", *(f"- {note}" for note in notes)]) + "\n"
