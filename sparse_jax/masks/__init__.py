"""Attention-mask algebra: small composable mask descriptions that compile to dense arrays,
block layouts and TPU splash-attention masks.

A :class:`Mask` is a *description*, not an array: a predicate on (query index, key index) that
broadcasts over numpy or ``jax.numpy`` integer index arrays (True = may attend). One small frozen
dataclass per mask kind (``Causal``, ``Local``, ``Sink``, ...) holds the parameters of that kind
and nothing else; ``&``, ``|`` and ``~`` build new masks (``And``, ``Or``, ``Not``), so a pattern
such as "causal sliding window of 256 keys plus 4 attention sinks" is written::

    m = causal() & (local(256, 0) | sink(4))

and costs nothing until it is evaluated. The same object is then turned into what a consumer
needs:

* ``m.dense(q_len, kv_len)``: a numpy bool array ``[q, kv]`` (``[h, q, kv]`` for per-head masks,
  ``[b, ...]`` in front for run-time padding masks), for references and small problems;
* ``m.predicate(q_idx, kv_idx)``: the predicate itself, which also accepts jnp arrays (traced
  inside ``jax.jit``), so a kernel can compute the mask of one block on the fly;
* ``m.blocks(q_len, kv_len, block_q, block_kv)``: a :class:`BlockLayout` (numpy, computed at
  trace time): for each query block the non-empty key blocks, which of them are full, and
  deduplicated partial-block masks. This is what block-sparse kernels consume. Each mask kind
  also classifies whole blocks from their index ranges (``_block_bounds``), so only blocks that
  are neither certainly empty nor certainly full are evaluated element by element, a chunk at a
  time (how long that takes per kind: docs/benchmarks.md, "Design measurements");
* ``m.to_splash(q_len, kv_len)``: the equivalent mask object of
  ``jax.experimental.pallas.ops.tpu.splash_attention`` (native ``CausalMask``/``LocalMask``/...
  where one matches, ``NumpyMask`` otherwise).

Positions and offsets. Row ``i`` of a mask is the query at *absolute* position ``i`` and column
``j`` the key at position ``j``. ``m.with_offset(t)`` (decoding with a cache of ``t`` tokens)
maps row ``i`` to absolute position ``i + t`` for the whole sub-expression it wraps, so
``causal().with_offset(t).dense(1, t + 1)`` is a single row of ones.

Shapes. Most masks are defined for any length (``shape is None``). ``from_array`` masks (and
expressions containing one) have a fixed ``shape == (q, kv)``; ``dense``/``blocks``/``to_splash``
then require ``q_len <= q`` and ``kv_len <= kv`` and use the top-left corner.

Per-head masks. ``per_head([m0, m1, ...])`` (or ``from_array`` of a ``[h, q, kv]`` array) gives
one mask per head; combining it with a head-agnostic mask applies that mask to every head, and
two per-head masks must have the same number of heads. ``num_heads`` is None for head-agnostic
masks. ``m.for_head(h)`` extracts the ``[q, kv]`` mask of head ``h``.

Run-time masks. ``padding(lengths)`` (key ``j`` allowed for batch element ``b`` when
``j < lengths[b]``) and ``segments(q_ids, kv_ids)`` (packed sequences: query ``i`` sees key
``j`` when their segment ids are equal) depend on data known only at run time (their arrays
may be traced jax arrays). Any expression containing one is *dynamic* (``m.is_dynamic``,
``m.batch_size``):

* ``dense`` adds a leading batch axis ``[b, (h,) q, kv]`` (a jax array if ``lengths`` is one);
* ``predicate`` takes ``batch=`` indices (and ``head=`` for per-head masks);
* ``blocks`` returns a *conservative* layout valid for every value of the lengths: each padding
  leaf counts as "unknown" (a lower bound of all False and an upper bound of all True, combined
  by the usual rules, ``~`` swapping them). A block is kept when the upper bound has a True in
  it, full when the lower bound is all True, and partial otherwise; the stored partial-block
  mask is then the static *upper bound*, and the exact mask of such a block is
  ``partial_mask & m.predicate(q_idx, kv_idx, batch=b)``, which a kernel evaluates at run time.
  ``BlockLayout.dynamic`` is True for such layouts;
* ``to_splash`` raises (splash handles padding and segments with ``SegmentIds``, not with its
  mask).

The random, per-pair-independent :func:`random_blocks` pattern uses a counter-based integer hash
of (seed, query block, key block), so it is identical in numpy and inside ``jax.jit``, and a
shorter sequence sees a prefix of the pattern of a longer one.

The package's modules, each importing only those above it in this list: ``layouts``
(:class:`BlockLayout` and its computation), ``algebra`` (:class:`Mask`, ``&``/``|``/``~``,
``with_offset``, ``per_head``), ``kinds`` (the kinds given by arithmetic on the positions),
``lookups`` (``global_tokens``, ``random_blocks``, ``from_array``) and ``runtime``
(``padding``, ``segments`` and how kernels take them apart). Every public name is re-exported
here: ``from sparse_jax.masks import causal``.
"""

from __future__ import annotations

from sparse_jax.masks.algebra import And, Mask, Not, Or, PerHead, Shifted, check_mask, per_head
from sparse_jax.masks.kinds import (
    Causal,
    Chunked,
    Dilated,
    Fixed,
    Full,
    Local,
    Sink,
    Strided,
    causal,
    chunked,
    dilated,
    fixed,
    full,
    local,
    sink,
    strided,
)
from sparse_jax.masks.layouts import SENTINEL, BlockLayout, check_layout
from sparse_jax.masks.lookups import (
    FromArray,
    GlobalTokens,
    RandomBlocks,
    from_array,
    global_tokens,
    random_blocks,
)
from sparse_jax.masks.runtime import (
    Padding,
    Segments,
    TileExpression,
    jax_nn_mask,
    key_lengths,
    padding,
    query_padding,
    runtime_leaves,
    segment_ids,
    segments,
    split_runtime,
    tile_expression,
)

__all__ = [
    "SENTINEL",
    "And",
    "BlockLayout",
    "Causal",
    "Chunked",
    "Dilated",
    "Fixed",
    "FromArray",
    "Full",
    "GlobalTokens",
    "Local",
    "Mask",
    "Not",
    "Or",
    "Padding",
    "PerHead",
    "RandomBlocks",
    "Segments",
    "Shifted",
    "Sink",
    "Strided",
    "TileExpression",
    "causal",
    "check_layout",
    "check_mask",
    "chunked",
    "dilated",
    "fixed",
    "from_array",
    "full",
    "global_tokens",
    "jax_nn_mask",
    "key_lengths",
    "local",
    "padding",
    "per_head",
    "query_padding",
    "random_blocks",
    "runtime_leaves",
    "segment_ids",
    "segments",
    "sink",
    "split_runtime",
    "strided",
    "tile_expression",
]
