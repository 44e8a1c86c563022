"""The learned block selector as a candidate of the student's bank
(sparse_jax.block_gate.LearnedBlockSelection): the layer ranks the blocks with the gate it holds,
the gate is trained by the layer's own attention (``aux["selector_kl"]``) and by nothing else,
hardening carries the gates of the kept heads, and the main job offers it
(``--student.select-gate learned``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_jax.block_gate import LearnedBlockSelection, block_gate_loss
from sparse_jax.dispatch import attention
from sparse_jax.dynamic import BlockSelection
from sparse_jax.models.layers import CandidateMaskAttention, FixedAttention
from tests.test_block_gate import reference_scores
from tests.test_block_selection import _selection_work, _window, inputs

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _randomize(gate, seed):
    """Gate maps far from the pooled score (the identity), so that the selection changes."""
    kq, kk = jax.random.split(jax.random.key(seed))
    gate.w_q[...] = jax.random.normal(kq, gate.w_q[...].shape)
    gate.w_k[...] = jax.random.normal(kk, gate.w_k[...].shape)


def reference_selection(scores, keep, block, t):
    """numpy: each query's own block, then its ``keep`` earlier blocks of highest score (ties to
    the lower block), causal; ``scores [B, N, T, nk]`` (-inf: not a candidate)."""
    b, n = scores.shape[:2]
    out = np.zeros((b, n, t, t), bool)
    for bi in range(b):
        for h in range(n):
            for i in range(t):
                row = scores[bi, h, i]
                earlier = [c for c in range(len(row)) if np.isfinite(row[c])]
                order = sorted(earlier, key=lambda c: (-row[c], c))
                for c in [i // block, *order[:keep]]:
                    out[bi, h, i, c * block : min((c + 1) * block, i + 1)] = True
    return out


def _layer(cands, logits, **kw):
    layer = CandidateMaskAttention(2, cands, granularity="head", head_dim=8, **kw)
    layer.logits[...] = jnp.asarray(logits, jnp.float32)
    return layer


@pytest.mark.parametrize("combine", ["soft_union", "mixture"])
def test_a_fresh_learned_selection_selects_as_the_pooled_one(combine):
    q, k, v = inputs(n=2, kh=2)
    logits = [[0.7, -1.2], [-0.4, 2.0]]
    pooled = _layer([BlockSelection(1, block=3), _window(2)], logits, combine=combine)
    learned = _layer([LearnedBlockSelection(1, block=3), _window(2)], logits, combine=combine)
    assert pooled.selector_gates is None and list(learned.selector_gates.keys()) == ["0"]
    np.testing.assert_allclose(learned(q, k, v)[0], pooled(q, k, v)[0], **TOL)


def test_the_layer_ranks_the_blocks_by_its_gate():
    """Head 0 keeps the selection alone (sparsemax weights 1/0): its attention is exact under
    the blocks that the numpy reference ranks by the gate's scores, not by the pooled ones."""
    sel = LearnedBlockSelection(keep_blocks=1, block=3)
    layer = _layer([sel, _window(2)], [[5.0, -5.0], [-5.0, 5.0]], weighting="sparsemax")
    _randomize(layer.selector_gates["0"], 1)
    q, k, v = inputs(n=2, kh=2)
    gate = layer.selector_gates["0"]
    scores = reference_scores(q, k, gate.w_q[...], gate.w_k[...], 3, 1)
    chosen = reference_selection(scores, 1, 3, 11)
    assert (chosen != np.asarray(BlockSelection(1, block=3).dense(q, k))).any()  # not pooled
    window = np.tri(11, dtype=bool) & ~np.tri(11, k=-2, dtype=bool)
    want = np.stack(np.broadcast_arrays(chosen[:, 0], window), axis=1)
    np.testing.assert_allclose(layer(q, k, v)[0], attention(q, k, v, mask=want), **TOL)


def test_selector_kl_is_the_gates_loss_on_the_layers_own_attention_and_trains_only_the_gate():
    sel = LearnedBlockSelection(keep_blocks=1, block=3)
    layer = _layer([sel, _window(2)], [[0.5, 0.2], [-0.3, 0.1]])
    _randomize(layer.selector_gates["0"], 2)
    q, k, v = inputs(n=2, kh=2)
    _, aux = layer(q, k, v)
    # Recomputed: causal softmax of scale q.k, summed per earlier block, against the gate.
    qn, kn = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 1, axis=2)
    s = np.einsum("bind,bjnd->bnij", qn, kn) / np.sqrt(8)
    s = np.where(np.tri(11, dtype=bool), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    gate = layer.selector_gates["0"]
    scores = reference_scores(q, k, gate.w_q[...], gate.w_k[...], 3, 1)
    nk = scores.shape[-1]
    mass = np.pad(w, ((0, 0),) * 3 + ((0, nk * 3 - 11),)).reshape(*w.shape[:3], nk, 3).sum(-1)
    mass = np.where(np.isfinite(scores), mass, 0.0)
    want = block_gate_loss(jnp.asarray(scores, jnp.float32), jnp.asarray(mass, jnp.float32))
    np.testing.assert_allclose(aux["selector_kl"], want, rtol=1e-5)
    assert float(aux["selector_kl"]) > 0.01
    # The gate learns from selector_kl alone; the logits and the queries do not.
    grads = nnx.grad(lambda m: m(q, k, v)[1]["selector_kl"])(layer)
    assert np.abs(np.asarray(grads.selector_gates["0"].w_q[...])).max() > 1e-4
    assert np.abs(np.asarray(grads.logits[...])).max() == 0.0
    dq = jax.grad(lambda q: layer(q, k, v)[1]["selector_kl"])(q)
    assert np.abs(np.asarray(dq)).max() == 0.0
    # The output's loss does not reach the gate (the selection is not differentiated).
    grads = nnx.grad(lambda m: jnp.sum(m(q, k, v)[0] ** 2))(layer)
    assert np.abs(np.asarray(grads.selector_gates["0"].w_q[...])).max() == 0.0
    assert np.abs(np.asarray(grads.logits[...])).max() > 1e-6
    # No selector loss when decoding into a cache (no whole sequence to learn from).
    assert "selector_kl" not in layer(q[:, :1], k, v, q_offset=jnp.int32(0))[1]


def _student():
    """A tiny GPT-2 student with a learned selection and a head gate: in each block head 0
    keeps the selection alone, head 1 is closed by its gate (hardening removes it), head 2
    keeps a 3-key window and the selection. Sigmoid weights at 1 or e^-30: hardening is exact."""
    from sparse_jax.models.gpt2 import GPT2, AttentionSpec, GPT2Config

    sel = LearnedBlockSelection(keep_blocks=1, block=4)
    spec = AttentionSpec(kind="candidates", candidates=(sel, _window(3)), granularity="head",
                         head_gate="sigmoid_ste")  # fmt: skip
    student = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))
    for i, block in enumerate(student.h):
        block.attn.core.logits[...] = jnp.array([[30.0, -30.0], [-30.0, 30.0], [30.0, 30.0]])
        block.attn.head_gate.logits[...] = jnp.array([3.0, -3.0, 3.0])
        _randomize(block.attn.core.selector_gates["0"], 10 + i)
    return student, sel


def test_hardening_keeps_the_gates_of_the_kept_heads_and_the_students_function():
    from sparse_jax.models import harden
    from sparse_jax.models.gpt2 import generate

    student, sel = _student()
    hard = harden(student)
    assert hard.config.heads_per_layer == (2, 2)
    for sb, hb in zip(student.h, hard.h, strict=True):
        core = hb.attn.core
        assert isinstance(core, FixedAttention) and core.selections == (sel,)
        assert core.selected == ((True,), (True,))
        src, dst = sb.attn.core.selector_gates["0"], core.selector_gates["0"]
        np.testing.assert_array_equal(dst.w_q[...], src.w_q[...][np.array([0, 2])])
        np.testing.assert_array_equal(dst.w_k[...], src.w_k[...][np.array([0, 2])])
    ids = jax.random.randint(jax.random.key(1), (2, 16), 0, student.config.vocab_size)
    np.testing.assert_allclose(hard(ids), student(ids), rtol=1e-4, atol=1e-4)
    # The same model ranked by the pooled score computes something else: the gates count.
    pooled = harden(student)
    for block in pooled.h:
        gate = block.attn.core.selector_gates["0"]
        gate.w_q[...] = jnp.broadcast_to(jnp.eye(16, 16), gate.w_q[...].shape)
        gate.w_k[...] = jnp.broadcast_to(jnp.eye(48, 16), gate.w_k[...].shape)
    assert np.abs(np.asarray(pooled(ids) - hard(ids))).max() > 1e-3
    # Decoding into a cache ranks the same blocks as the whole sequence.
    out, logits = generate(hard, ids[:, :9], 6, temperature=0.0, return_logits=True)
    np.testing.assert_allclose(logits, hard(out)[:, 8:-1], rtol=1e-4, atol=1e-4)


def test_a_hardened_learned_head_runs_the_gather_engine_on_its_gates_blocks():
    student, sel = _student()
    core = __import__("sparse_jax.models", fromlist=["harden"]).harden(student).h[0].attn.core
    gate = core.selector_gates["0"]
    q, k, v = inputs(t=1024, n=2, kh=2, d=16, b=1)
    assert "gather" in _selection_work(lambda q, k, v: core(q[:, :, :1], k[:, :, :1],
                                                            v[:, :, :1])[0], q, k, v)  # fmt: skip
    # Head 0 alone: the selection's engine with the gate's scores of head 0.
    out = core(q, k, v)[0][:, :, :1]
    scores = gate.scores(q[:, :, :1], k[:, :, :1], heads=[0])
    want = sel.attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], block_scores=scores)
    np.testing.assert_allclose(out, want, **TOL)
    pooled = sel.attention(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    assert np.abs(np.asarray(out - pooled)).max() > 1e-3


def test_a_learned_selection_needs_the_head_dim():
    sel = LearnedBlockSelection(1, block=4)
    with pytest.raises(ValueError, match=r"CandidateMaskAttention: a LearnedBlockSelection .*"
                                         r"`head_dim`"):  # fmt: skip
        CandidateMaskAttention(2, [sel])
    with pytest.raises(ValueError, match=r"FixedAttention: a LearnedBlockSelection"):
        FixedAttention(2, selections=[sel])
    with pytest.raises(ValueError, match="gate_dim"):
        LearnedBlockSelection(1, block=4, gate_dim=0)
    with pytest.raises(ValueError, match=r"LearnedBlockSelection: `pool` must be one of"):
        LearnedBlockSelection(1, block=4, pool="mean")


def test_the_main_job_offers_the_learned_selector(tmp_path, capsys):
    from experiments import distill
    from experiments.distill import phases
    from sparse_jax.models import GPT2, GPT2Config
    from tests.test_distill import _args

    flags = ["--student.select-blocks", "2", "--student.select-block", "4"]
    config = distill.parse(_args(tmp_path, "run", *flags, "--student.select-gate", "learned"))
    spec = phases.student_spec(config)
    assert spec.candidates[-1] == LearnedBlockSelection(2, block=4)
    by_max = distill.parse(_args(tmp_path, "run", *flags, "--student.select-gate", "learned",
                                 "--student.select-pool", "max"))  # fmt: skip
    assert phases.student_spec(by_max).candidates[-1] == LearnedBlockSelection(
        2, block=4, pool="max"
    )
    assert phases.trainable(config) == "core/logits"  # the gates learned before the search
    in_search = distill.parse(_args(tmp_path, "run", *flags, "--student.select-gate", "learned",
                                    "--train.selector-steps", "0"))  # fmt: skip
    assert phases.trainable(in_search) == "core/logits|core/selector_gates"
    pooled = distill.parse(_args(tmp_path, "run", *flags))
    assert type(phases.student_spec(pooled).candidates[-1]) is BlockSelection
    assert phases.trainable(pooled) == "core/logits"
    with pytest.raises(SystemExit):
        distill.parse(_args(tmp_path, "run", "--student.select-gate", "learned"))
    message = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert (
        "--student.select-gate learned ranks the blocks of --student.select-blocks: it "
        "needs --student.select-blocks >= 1; got 0" in message
    )
    with pytest.raises(SystemExit):
        distill.parse(_args(tmp_path, "run", *flags, "--student.select-pool", "max"))
    message = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert "--student.select-pool max pools the target of learned gates: it needs" in message
    # The objective weighs the selectors' loss by --loss.selector-kl, from the first update.
    student = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))
    for i, block in enumerate(student.h):  # a random model attends evenly: gates away from it
        _randomize(block.attn.core.selector_gates[str(len(spec.candidates) - 1)], i)
    teacher = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(1))
    batch = jax.random.randint(jax.random.key(0), (2, 17), 0, 101)
    losses = {}
    for weight in (0.0, 2.0):
        c = distill.parse(_args(tmp_path, "run", *flags, "--student.select-gate", "learned",
                                "--loss.selector-kl", str(weight)))  # fmt: skip
        loss, metrics = phases.objective(c, ramp=(100, 200))(
            student, batch, jax.random.key(0), teacher, 0
        )
        losses[weight] = float(loss)
    kl = float(metrics["penalty_mask_selector_kl"])
    assert kl > 0
    np.testing.assert_allclose(losses[2.0] - losses[0.0], 2.0 * kl, rtol=1e-4)
    # A search that holds the gates (the selector phase trained them) leaves that loss out, and
    # its compiled update never computes the gates' target (the causal attention weights).
    held = phases.objective(c, ramp=(100, 200), selectors=False)
    loss, metrics = held(student, batch, jax.random.key(0), teacher, 0)
    assert "penalty_mask_selector_kl" not in metrics
    np.testing.assert_allclose(float(loss), losses[0.0], rtol=1e-6)

    def exps(fn):
        text = jax.jit(lambda b: fn(student, b, jax.random.key(0), teacher, 0)[0]).lower(batch)
        return text.compile().as_text().count("exponential")

    assert exps(held) < exps(phases.objective(c, ramp=(100, 200)))


def _values(model) -> dict[str, np.ndarray]:
    """A copy of every parameter's value, by its '/'-joined path."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, k)): np.array(v[...]) for k, v in flat}


def test_the_selector_phase_trains_the_gates_alone_at_the_serving_length(tmp_path, monkeypatch):
    """--train.selector-steps: a phase before the search in which only the gates learn, on
    sequences of --student.serve-len-factor x --data.seq-len; the search then holds them."""
    import json

    from experiments import distill
    from experiments.distill import phases
    from experiments.distill.run_folder import Run
    from sparse_jax.models import student_from_teacher
    from tests.test_distill import _args

    flags = ["--student.select-blocks", "1", "--student.select-block", "4",
             "--student.select-gate", "learned", "--train.selector-steps", "2",
             "--train.steps", "2", "--student.serve-len-factor", "2"]  # fmt: skip
    config = distill.parse(_args(tmp_path, "run", *flags))
    seen = {}
    train_phase = Run.train_phase

    def spy_phase(self, name, model, loss, tc, **kwargs):
        batches = kwargs.get("batches")
        first = None if batches is None else np.asarray(next(batches(None)))
        before = _values(model)
        trained = train_phase(self, name, model, loss, tc, **kwargs)
        seen[name] = (tc, first, before, _values(trained))
        return trained

    monkeypatch.setattr(Run, "train_phase", spy_phase)
    run = Run(config)
    teacher = phases.teacher(run)
    phases.student(run, teacher)
    assert list(seen) == ["teacher", "selector", "student"]
    tc, first, before, after = seen["selector"]
    assert tc.trainable == "core/selector_gates" and tc.steps == 2
    assert phases.selector_length(config, teacher) == 32  # 2 x 16, within the 37 positions
    assert first.shape[-1] == 33 and tc.batch_size == 4 * 16 // 32
    longer = distill.parse(_args(tmp_path, "run", *flags[:-1], "4"))
    assert phases.selector_length(longer, teacher) == 16  # 64 > 37 positions: --data.seq-len

    def changed(a, b):
        return {name for name in a if not np.array_equal(a[name], b[name])}

    moved = changed(before, after)
    assert moved and all("selector_gates" in name for name in moved), sorted(moved)
    fresh = _values(student_from_teacher(teacher, phases.student_spec(config)))
    assert not changed(fresh, before)  # the phase starts from the student as built
    # The search trains the candidate logits and holds the gates.
    _, _, searched_from, searched = seen["student"]
    assert not changed(after, searched_from)
    assert all("core/logits" in name for name in changed(searched_from, searched))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    selector = [x for x in lines if x["phase"] == "selector"]
    assert [x["step"] for x in selector] == [1, 2]
    assert all(x["selector_kl"] == x["loss"] and np.isfinite(x["loss"]) for x in selector)
    assert np.isfinite(selector[-1]["eval_loss"])  # held-out sequences of the same length
