"""What the distillation job measures: quality on the evaluation split, speed, attention time,
the candidate weights a model keeps (as the log and the summary record them), the blocks its
masks make the kernel compute, how well a student found a planted teacher's masks, and samples
(greedy and by temperature).

Example::

    from experiments.common import measure

    nll, kl = measure.evaluate_lm(student, windows, teacher)  # windows: [N, T + 1] int32
    table = measure.recall_accuracy(teacher, "byte", lengths=(128, 512))  # {(T, depth): acc}
    tokens_per_s, ms = measure.speed(student, seq_len=512, vocab=257)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.common import timing
from sparse_jax import masks
from sparse_jax.data import recall
from sparse_jax.data.tokenizers import get_tokenizer
from sparse_jax.models import AttentionSpec, generate, student_from_teacher
from sparse_jax.models.flops import mask_block_cost
from sparse_jax.models.layers import FixedAttention
from sparse_jax.training.losses import cross_entropy_loss, distillation_loss
from sparse_jax.training.sharding import local_model

__all__ = [
    "attention_core_call",
    "attention_time",
    "block_maps",
    "candidate_weights",
    "cost",
    "evaluate_lm",
    "layer_density",
    "planted_recovery",
    "planted_swaps",
    "recall_accuracy",
    "sample_texts",
    "speed",
    "weight_metrics",
]

# ----------------------------------------------------------------------------------------------
# Quality.


@functools.partial(jax.jit, static_argnames=("graphdef", "teacher_def"))
def _eval_scores(graphdef, state, teacher_def, teacher_state, windows):
    ids, targets = windows[:, :-1], windows[:, 1:]
    logits = nnx.merge(graphdef, state)(ids)
    nll, _ = cross_entropy_loss(logits, targets)
    if teacher_def is None:
        return nll, jnp.float32(0.0)
    teacher_logits = nnx.merge(teacher_def, teacher_state)(ids)
    return nll, distillation_loss(logits, teacher_logits)[1]["kl"]


def evaluate_lm(model, windows: np.ndarray, teacher=None, batch: int = 8):
    """(mean next-token NLL, mean KL(teacher || model) or None) over ``windows``; each process
    evaluates all of them on its own device."""
    graphdef, state = nnx.split(local_model(model))
    teacher = local_model(teacher) if teacher is not None else None
    teacher_def, teacher_state = nnx.split(teacher) if teacher is not None else (None, None)
    nlls, kls, sizes = [], [], []
    for start in range(0, len(windows), batch):
        w = jnp.asarray(windows[start : start + batch])
        nll, kl = _eval_scores(graphdef, state, teacher_def, teacher_state, w)
        nlls.append(float(nll))
        kls.append(float(kl))
        sizes.append(len(w))  # every window has the same length: weight a batch by its windows
    nll = float(np.average(nlls, weights=sizes))
    return nll, (float(np.average(kls, weights=sizes)) if teacher is not None else None)


@functools.partial(jax.jit, static_argnames="graphdef")
def _argmax(graphdef, state, ids):
    return jnp.argmax(nnx.merge(graphdef, state)(ids), axis=-1)


#: Where the key is stated in :func:`recall_accuracy`'s sequences (fractions of the filler).
RECALL_DEPTHS = (0.1, 0.5, 0.9)


def recall_accuracy(
    model,
    tokenizer: str,
    filler=None,
    *,
    lengths,
    depths=RECALL_DEPTHS,
    count: int = 48,
    seed: int = 1_000_000,
    batch: int = 8,
) -> dict[tuple[int, float], float]:
    """Passkey recall of ``model``: ``{(length, depth): exact-match accuracy}`` over ``count``
    sequences per length (the depths cycled over them), each graded by its greedy answer
    (:func:`sparse_jax.data.recall.continuations_from_argmax`, one forward pass; ``model`` must
    be causal: shorter sequences are read padded to the longest). ``filler``:
    as :func:`~sparse_jax.data.recall.make_examples` takes it (None: the embedded corpus's
    evaluation split, text the trained models have not seen)."""
    if filler is None:
        filler = recall.default_filler(tokenizer, "eval")
    graphdef, state = nnx.split(local_model(model))
    longest = max(lengths) - 1
    batches, answers = [], []
    for length in lengths:
        examples = recall.make_examples(
            "passkey", tokenizer, filler, length=length, count=count, depths=depths, seed=seed
        )
        # Every call reads [batch, longest] ids (zeros after a shorter sequence's end, which a
        # causal model's earlier positions never see): one compiled program for all lengths.
        ids = np.zeros((-(-count // batch) * batch, longest), np.int32)
        ids[:count, : length - 1] = examples.ids[:, :-1]
        predicted = np.concatenate([
            np.asarray(_argmax(graphdef, state, jnp.asarray(ids[i : i + batch])))
            for i in range(0, len(ids), batch)
        ])[:count, : length - 1]  # fmt: skip
        batches.append(examples)
        answers.append(recall.continuations_from_argmax(examples, predicted))
    return recall.score(batches, answers)


#: The temperature of the sampled continuations (besides the greedy ones).
SAMPLE_TEMPERATURE = 0.8


def sample_texts(
    teacher, hard, windows: np.ndarray, tokenizer: str, seq_len: int, prompts: int, seed: int = 0
):
    """Continuations of the first ``prompts`` evaluation windows by the teacher and the
    hardened model, decoded: greedy, and sampled at :data:`SAMPLE_TEMPERATURE` with the same key
    for both models (``jax.random.key(seed + i)`` for prompt ``i``):
    ``[{"prompt", "teacher", "hardened", "teacher_sampled", "hardened_sampled",
    "temperature"}]``."""
    tok = get_tokenizer(tokenizer)
    prompt_len, new = min(32, seq_len // 2), min(48, seq_len // 2)
    out = []
    for i in range(min(prompts, len(windows))):
        prompt = jnp.asarray(windows[i : i + 1, :prompt_len])
        texts = {"prompt": tok.decode(np.asarray(prompt[0]).tolist())}
        texts["temperature"] = SAMPLE_TEMPERATURE
        key = jax.random.key(seed + i)
        for name, model in (("teacher", teacher), ("hardened", hard)):
            greedy = generate(model, prompt, new, temperature=0.0)[0, prompt_len:]
            sampled = generate(model, prompt, new, temperature=SAMPLE_TEMPERATURE, rng=key)
            texts[name] = tok.decode(np.asarray(greedy).tolist())
            texts[f"{name}_sampled"] = tok.decode(np.asarray(sampled[0, prompt_len:]).tolist())
        out.append(texts)
    return out


# ----------------------------------------------------------------------------------------------
# Speed (experiments.common.timing: compiled ahead, warm-up excluded, models timed in alternation,
# median of the rounds).

# Rounds of alternating calls, at least MIN_ROUNDS and then until TIME_BUDGET_S seconds of calls.
ROUNDS, MIN_ROUNDS, TIME_BUDGET_S = 30, 5, 10.0


def _forward_call(model, seq_len: int, vocab: int):
    """``(fn, args)``: a jitted forward pass of ``model`` on one sequence of ``seq_len``."""
    graphdef, state = nnx.split(model)
    ids = jax.random.randint(jax.random.key(0), (1, seq_len), 0, vocab, jnp.int32)

    def forward(state, ids):
        return nnx.merge(graphdef, state)(ids)

    return forward, (state, ids)


def attention_core_call(core, q, k, v) -> tuple:
    """``(fn, (state, q, k, v))``: an attention core alone (scores, normalizer, values; no
    projections), as the model runs it, as a function of its state and ``q, k, v [B, T, N,
    H]``."""
    graphdef, state = nnx.split(core)

    def call(state, q, k, v):
        return nnx.merge(graphdef, state)(q, k, v)[0]

    return call, (state, q, k, v)


def _attention_calls(model, seq_len: int) -> list:
    """:func:`attention_core_call` per block with heads, on random ``[1, seq_len, heads,
    head_dim]`` queries, keys and values."""
    calls = []
    for i, block in enumerate(model.h):
        heads = block.attn.num_heads
        if not heads:
            continue
        keys = jax.random.split(jax.random.key(i), 3)
        shape = (1, seq_len, heads, model.config.head_dim)
        q, k, v = (jax.random.normal(key, shape) for key in keys)
        calls.append(attention_core_call(block.attn.core, q, k, v))
    return calls


def _timed(calls: list) -> list[float]:
    stats = timing.time_interleaved(
        calls, rounds=ROUNDS, min_rounds=MIN_ROUNDS, budget_s=TIME_BUDGET_S
    )
    return [s.median_ms for s in stats]


def speed(model, seq_len: int, vocab: int) -> tuple[float, float]:
    """(tokens/s, ms) of a jitted forward pass on one sequence of ``seq_len`` tokens."""
    (ms,) = _timed([_forward_call(model, seq_len, vocab)])
    return seq_len / (ms / 1e3), ms


def attention_time(model, seq_len: int) -> float:
    """Milliseconds of the attention cores alone (scores, normalizer, values; no projections),
    summed over the blocks: each block's jitted core on random ``[1, seq_len, heads, head_dim]``
    queries, keys and values, median of repeated calls."""
    return sum(_timed(_attention_calls(model, seq_len)))


def cost(teacher, hard, seq_len: int) -> dict[str, float]:
    """Teacher against hardened student at ``seq_len``: measured attention time and forward
    speed (the two models' calls in alternation, median of the rounds), analytic FLOPs
    (GPT2.flops) and attention density."""
    vocab = teacher.config.vocab_size
    # Each pair timed in alternation (teacher, student, teacher, ...): a machine that slows
    # down or speeds up during the measurement moves both alike.
    t_ms, h_ms = _timed(
        [_forward_call(teacher, seq_len, vocab), _forward_call(hard, seq_len, vocab)]
    )
    t_tps, h_tps = seq_len / (t_ms / 1e3), seq_len / (h_ms / 1e3)
    t_cores, h_cores = _attention_calls(teacher, seq_len), _attention_calls(hard, seq_len)
    core_ms = _timed(t_cores + h_cores)
    t_attn_ms, h_attn_ms = sum(core_ms[: len(t_cores)]), sum(core_ms[len(t_cores) :])
    f_t, f_h = teacher.flops(seq_len), hard.flops(seq_len)
    return {
        "teacher_attention_ms": t_attn_ms,
        "hardened_attention_ms": h_attn_ms,
        "teacher_tokens_per_s": t_tps,
        "hardened_tokens_per_s": h_tps,
        "teacher_ms": t_ms,
        "hardened_ms": h_ms,
        "teacher_flops_per_token": f_t.per_token,
        "hardened_flops_per_token": f_h.per_token,
        "teacher_attention_flops": f_t.attention,
        "hardened_attention_flops": f_h.attention,
        "hardened_density": f_h.attention_density,
        "teacher_density": f_t.attention_density,
    }


def layer_density(model, seq_len: int) -> list[float]:
    """Attention density of each block at ``seq_len`` (as GPT2.flops counts it)."""
    return [layer.attention_density for layer in model.flops(seq_len).layers]


# ----------------------------------------------------------------------------------------------
# What a model keeps, as the run's log and summary record it (the models answer it themselves:
# GPT2.attention_density, GPT2.candidate_weights, GPT2.flops).


def weight_metrics(model) -> dict[str, jax.Array]:
    """Scalar metrics ``w/block<i>/c<j>``: candidate ``j``'s weight in block ``i`` (mean over
    heads), for the report's weight-evolution plot. Traceable."""
    out = {}
    for i, w in enumerate(model.candidate_weights()):
        if w is not None:
            w = w.mean(axis=0)
            out |= {f"w/block{i}/c{j}": w[j] for j in range(w.shape[0])}
    return out


def block_maps(model, seq_len: int) -> dict:
    """What the kernel computes in each head at ``seq_len``: per block, per head, the block map
    of the head's mask (``[nq, nk]``, 0 = skipped, 1 = partial, 2 = full; see
    :meth:`~sparse_jax.masks.BlockLayout.block_mask`) at the block's block size, with the
    mask's repr: ``{"seq_len", "blocks": [[{"mask", "block_size", "map"}] per head]}``. A head
    that adds a :class:`~sparse_jax.dynamic.BlockSelection` to its mask also lists it under
    ``"selections"`` (its map is the static mask's: the chosen blocks depend on the input)."""
    blocks = []
    for block, spec in zip(model.h, model.specs, strict=True):
        heads = []
        if block.attn.num_heads:
            core = block.attn.core
            for h, mask in enumerate(core.head_masks()):
                fixed = isinstance(core, FixedAttention)
                bq, bk = core.head_block_size(h) if fixed else spec.block_size
                layout = mask.blocks(seq_len, seq_len, bq, bk)
                head = {
                    "mask": repr(mask),
                    "block_size": [bq, bk],
                    "map": layout.block_mask()[0].tolist(),
                }
                chosen = core.head_selections(h) if fixed else ()
                heads.append(head | ({"selections": [repr(s) for s in chosen]} if chosen else {}))
        blocks.append(heads)
    return {"seq_len": seq_len, "blocks": blocks}


def planted_swaps(teacher, student, pattern: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """float64 ``[n_layer, n_head, C]``: KL(planted teacher ‖ the teacher with one head's
    planted mask swapped for candidate ``c``), nats/token on ``windows``; 0 where ``c`` is the
    planted candidate. It says which candidates are *as good on the data* as the planted one:
    a head whose output nothing downstream uses, or a window the data never needs to be wider,
    gives near-zero KL for several candidates, and no objective can tell them apart there.

    ``student`` is any model of the teacher's shape with candidate attention per head (its
    ``logits`` and weights are overwritten): the teacher's weights are copied into it and each
    head's weights set one-hot, so every swap reuses one compiled program."""
    spec = [b.attn.core for b in student.h]
    model = student_from_teacher(teacher, [_one_hot_spec(core) for core in spec])
    n_cand = len(spec[0].candidates)

    def set_choice(choice):  # choice [L, H] -> one-hot logits (sparsemax/softmax: weight 1)
        for block, row in zip(model.h, choice, strict=True):
            logits = np.full((len(row), n_cand), -30.0, np.float32)
            logits[np.arange(len(row)), row] = 0.0
            block.attn.core.logits[...] = jnp.asarray(logits)

    out = np.zeros((*pattern.shape, n_cand))
    for i in range(pattern.shape[0]):
        for h in range(pattern.shape[1]):
            for c in range(n_cand):
                if c == pattern[i, h]:
                    continue
                choice = pattern.copy()
                choice[i, h] = c
                set_choice(choice)
                out[i, h, c] = max(evaluate_lm(model, windows, teacher)[1], 0.0)
    return out


def masked_score_excess(teacher, windows: np.ndarray) -> np.ndarray:
    """float64 ``[n_layer, n_head]``: how far each head's scores *outside* its mask rise above
    the ones it attends to: the median, over ``windows`` and queries, of the largest scaled
    score ``q·k/√d`` on a causal key the head's mask excludes minus the log-sum-exp of the scaled
    scores on the keys it allows (NaN where the mask excludes no causal key: causal heads).

    A teacher trained with a mask never trains the scores it masks, so they can sit tens of
    nats above the attended ones. A student that combines candidate masks through a log-bias
    on the scores (``soft_union``) then cannot silence those keys with a small weight: the bias
    ``log w`` must fall below minus the excess, i.e. the weight must be exactly 0, so the KL
    is flat in the weights until they reach 0 (measured: docs/archive/results-history.md,
    "Planted masks").

    Example::

        masked_score_excess(planted_teacher, run.eval_windows)  # [4, 4]
    """
    teacher = local_model(teacher)
    ids = jnp.asarray(windows[:, :-1])
    t = ids.shape[1]
    causal = np.asarray(masks.causal().dense(t, t))
    positions = jnp.arange(t)
    x = teacher.embed(ids, positions).astype(jnp.float32)
    out = []
    for block in teacher.h:
        attn = block.attn
        q, k, _ = attn.project_qkv(block.ln_1(x), positions)
        scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / attn.head_dim**0.5
        row = []
        for h, mask in enumerate(attn.core.head_masks()):
            allowed = np.asarray(mask.dense(t, t)) & causal
            outside = causal & ~allowed
            queries = outside.any(axis=1) & allowed.any(axis=1)
            if not queries.any():
                row.append(float("nan"))
                continue
            s = scores[:, h][:, queries]  # [B, Q, T]
            inside = jax.nn.logsumexp(jnp.where(allowed[queries], s, -jnp.inf), axis=-1)
            above = jnp.max(jnp.where(outside[queries], s, -jnp.inf), axis=-1) - inside
            row.append(float(jnp.median(above)))
        out.append(row)
        x = block(x, positions)[0]
    return np.asarray(out, np.float64)


def swap_kl(teacher, specs, block: int, head: int, mask, windows: np.ndarray) -> float:
    """KL(planted teacher ‖ the same teacher with head ``head`` of block ``block`` under
    ``mask``), nats/token on ``windows``: :func:`planted_swaps` for any static mask (e.g. a
    union of candidates a student learned). ``specs`` are the planted teacher's
    AttentionSpecs, one per block, each with a per-head mask."""
    specs = list(specs)
    spec = specs[block]
    row = [spec.mask.for_head(h) for h in range(spec.mask.num_heads)]
    row[head] = mask
    specs[block] = dataclasses.replace(spec, mask=masks.per_head(row))
    swapped = student_from_teacher(teacher, specs)
    return max(evaluate_lm(swapped, windows, teacher)[1], 0.0)


def _one_hot_spec(core):
    """An AttentionSpec whose candidate weights can be set exactly one-hot: the candidates of
    ``core`` per head, sparsemax weights (exact zeros), noisy-OR combine (a single weight-1
    candidate *is* its mask)."""
    return AttentionSpec(
        kind="candidates",
        candidates=tuple(core.candidates),
        granularity="head",
        combine="soft_union",
        weighting="sparsemax",
        normalizer=core.normalizer,
        block_size=core.block_size,
    )


def planted_recovery(
    student,
    hard,
    pattern: np.ndarray,
    bank,
    seq_len: int,
    swaps=None,
    tolerance: float = 0.0,
    union_swap=None,
    threshold: float | None = None,
) -> dict:
    """How well the student found the planted teacher's masks.

    A head's *learned mask* is the union of the candidates its weights keep at ``threshold``
    (``kept_candidates(threshold)``, what threshold hardening keeps; None: the support of a
    sparsemax-like distribution, weight >= 0.5 and the strongest for sigmoid/softmax weights).
    Under the soft union the support is exactly where the head can attend; the weights
    re-weight positions inside it (window(8) beside window(16) adds weight to the nearest 8 of
    the 16 keys). Its *pick* is the candidate of ``bank`` whose mask at ``seq_len`` equals the
    learned mask (-1 when no candidate does).

    Returns ``planted`` (per block and head ``[planted, picked]``), ``planted_support`` (per
    block and head the kept candidates), ``planted_recovered`` (the fraction of heads that
    picked the planted candidate), ``planted_strongest`` (the fraction whose largest weight is
    the planted candidate's) and ``planted_hardened`` (the fraction whose hardened head runs
    exactly the planted mask at ``seq_len``).

    With ``swaps`` (:func:`planted_swaps`), a head that picked another candidate counts as
    *equivalent* when that candidate costs no more kernel blocks at ``seq_len`` than the planted
    one and swapping it into the teacher changes the teacher's output by at most ``tolerance``
    nats/token: ``planted_equivalent`` is the fraction of heads that picked the planted
    candidate or an equivalent one, and ``planted_swap_kl`` the picked candidate's swap KL per
    block and head. A learned mask that no candidate equals (a union) has its swap KL from
    ``union_swap(block, head, mask)`` (e.g. :func:`swap_kl`) and its cost from its own blocks;
    without ``union_swap`` it is None and the head is not equivalent.

    ``pattern`` is int ``[n_layer, n_head]`` (indices into ``bank``, the student's candidates)."""
    dense = [np.asarray(c.dense(seq_len, seq_len)) for c in bank]

    def candidate_equal_to(mask) -> int:
        m = np.asarray(mask.dense(seq_len, seq_len))
        return next((c for c, d in enumerate(dense) if np.array_equal(m, d)), -1)

    planted, support, swap_kl = {}, {}, {}
    picked_right, strongest_right, hardened_right, equivalent = [], [], [], []
    for i, w in enumerate(student.candidate_weights()):
        w = np.broadcast_to(np.asarray(w), (pattern.shape[1], len(bank)))
        core = student.h[i].attn.core
        costs = core.block_costs(seq_len)
        kept = np.asarray(core.kept_candidates(threshold))
        learned = core.head_masks(kept)
        hard_masks = hard.h[i].attn.core.head_masks() if hard.h[i].attn.num_heads else ()
        rows, kls = [], []
        for h, want in enumerate(pattern[i]):
            picked = candidate_equal_to(learned[h])
            rows.append([int(want), picked])
            picked_right.append(picked == want)
            strongest_right.append(int(np.argmax(w[h])) == want)
            hardened_right.append(h < len(hard_masks) and candidate_equal_to(hard_masks[h]) == want)
            if swaps is not None:
                if picked >= 0:
                    kl, cost = float(swaps[i, h, picked]), costs[picked]
                elif union_swap is not None:
                    kl = float(union_swap(i, h, learned[h]))
                    cost = mask_block_cost(learned[h], seq_len, core.block_size)
                else:
                    kl, cost = None, np.inf
                kls.append(kl)
                cheaper = cost <= costs[want] + 1e-12
                equivalent.append(picked == want or (cheaper and kl <= tolerance))
        planted[f"block{i}"] = rows
        support[f"block{i}"] = [np.flatnonzero(row).tolist() for row in kept]
        if swaps is not None:
            swap_kl[f"block{i}"] = kls
    out = {
        "planted_recovered": float(np.mean(picked_right)),
        "planted_strongest": float(np.mean(strongest_right)),
        "planted_hardened": float(np.mean(hardened_right)),
        "planted": planted,
        "planted_support": support,
    }
    if swaps is not None:
        out |= {
            "planted_equivalent": float(np.mean(equivalent)),
            "planted_tolerance": float(tolerance),
            "planted_swap_kl": swap_kl,
            "planted_swaps": np.asarray(swaps).round(5).tolist(),
        }
    return out


def candidate_weights(model) -> dict[str, list[list[float]]]:
    """Per block with learned masks: the candidate weights ``[heads or 1][C]``, rounded."""
    return {
        f"block{i}": np.asarray(w).round(4).tolist()
        for i, w in enumerate(model.candidate_weights())
        if w is not None
    }
