"""sparse_jax.cot and python -m experiments.cot: tokens (bytes, or whole numbers) round trip,
the chunked decoder equals greedy_decode, a Solver restored from a tiny trained run answers with
the model (its answers re-read and re-graded here), an untrained model does not pass, unreadable
questions are answered with the reason, evaluate()'s figures recomputed independently, the
experiment end to end (train, eval, ask, resume) and bad flags refused by name."""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx

from sparse_jax import cot
from sparse_jax.data import linalg_cot as lc
from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder, greedy_decode

SMALL = lc.GeneratorConfig(kinds=("rref", "solvability", "column_space"), rref_shape=(2, 3),
                           column_space_shape=(2, 2), solvability_dim=4, block_rate=0.0,
                           fraction_rate=0.0, max_entry=3, max_number=9, max_steps=6)  # fmt: skip
TINY = EncDecConfig(vocab_size=cot.VOCAB_SIZE, d_model=16, num_heads=2, d_ff=32,
                    encoder_layers=1, decoder_layers=1, cot_steps=1)  # fmt: skip
RREF = "Find the reduced row echelon form R of A = [[2, 4], [1, 3]]."


@functools.cache
def _problems(n: int = 9) -> tuple[lc.Problem, ...]:
    return lc.make_splits(train=0, validation=0, test=n, seed=3, config=SMALL)["test"]


# ---------------------------------------------------------------------------------------------
# Tokens and rows.


def test_tokens_round_trip_through_packed_rows():
    problems = _problems()
    fmt = cot.fit_format(problems)
    rows = cot.pack(problems, fmt)
    assert rows.shape == (len(problems), fmt.source_len + fmt.target_len + 1)
    b = cot.split_rows(jnp.asarray(rows), fmt.source_len)
    for i, p in enumerate(problems):
        q = bytes(np.asarray(b.source[i, : int(b.source_lengths[i])]).astype(np.uint8))
        assert q.decode() == p.question
        assert np.all(np.asarray(b.source[i, int(b.source_lengths[i]) :]) == cot.PAD_ID)
        assert int(b.target_in[i, 0]) == cot.BOS_ID
        # Teacher forcing: the input is the output shifted by one position.
        n = int(b.where[i].sum())
        np.testing.assert_array_equal(b.target_in[i, 1:n], b.target_out[i, : n - 1])
        text, tokens, finished = cot.decode_tokens(np.asarray(b.target_out[i]))
        assert (text, tokens, finished) == (p.solution_text(), n, True)
        assert lc.split_solution(text) == (p.steps, p.answer)
    # The format is the smallest multiple of 8 that holds every problem.
    longest_q = max(len(p.question.encode()) for p in problems)
    longest_t = max(len(p.solution_text().encode()) + 1 for p in problems)
    assert fmt.source_len - 8 < longest_q <= fmt.source_len
    assert fmt.target_len - 8 < longest_t <= fmt.target_len
    # Non-ASCII text survives; ids that are not bytes are dropped, EOS ends the text.
    ids = np.concatenate([cot.encode_question("x ≠ 0"), [cot.BOS_ID, cot.PAD_ID, 65]])
    assert cot.decode_tokens(np.append(ids, [cot.EOS_ID, 66])) == ("x ≠ 0A", ids.size + 1, True)


def _token_bytes(ids) -> list[int]:
    """How many bytes of text each id writes, read one id at a time (a byte id one)."""
    return [
        1 if i < cot.NUMBER_BASE else len(cot.decode_tokens([i])[0])
        for i in np.asarray(ids).tolist()
    ]


@pytest.mark.parametrize("numbers", [1, 10, 100])
def test_numbers_are_one_token_each_and_round_trip(numbers):
    fmt = cot.CotFormat(numbers=numbers)
    assert fmt.vocab_size == cot.VOCAB_SIZE + 2 * numbers - 1
    # Every number -N < n < N has its own id, those ids fill the vocabulary, each reads back.
    ids = [cot.number_token(n) for n in range(1 - numbers, numbers)]
    assert sorted(ids) == list(range(cot.NUMBER_BASE, fmt.vocab_size))
    assert [cot.decode_tokens([i])[0] for i in ids] == [str(n) for n in range(1 - numbers, numbers)]
    config = dataclasses.replace(SMALL, arithmetic=True, products=True)
    problems = [*_problems(30), *lc.make_splits(0, 0, 30, seed=4, config=config)["test"]]
    for text in [t for p in problems for t in (p.question, p.solution_text())] + [
        "x ≠ -0, 007, R2-1 = 3-12 = -9, (-1/2)*[-12, 123]"
    ]:
        ids, starts = fmt.tokens(text)
        assert np.array_equal(ids, cot.encode_question(text, fmt))
        assert cot.decode_tokens(np.append(ids, cot.EOS_ID)) == (text, ids.size + 1, True)
        # Each token starts where the text of the tokens before it ends.
        ends = np.cumsum(_token_bytes(ids))
        assert np.array_equal(starts, np.concatenate([[0], ends[:-1]]))
        data = text.encode()
        for i, at in zip(ids.tolist(), starts.tolist(), strict=True):
            if i >= cot.NUMBER_BASE:
                n = int(cot.decode_tokens([i])[0])
                assert abs(n) < numbers and data[at : at + len(str(n))] == str(n).encode()
                # A minus is the number's unless it follows what a subtraction follows.
                assert n >= 0 or at == 0 or not re.match(rb"[0-9A-Za-z)\]]", data[at - 1 : at])
        # What stays bytes is no number below N: a digit byte is the start of one only when
        # its run is too large or has a leading zero (or continues such a run).
        for m in re.finditer(rb"[0-9]+", data):
            j = m.start()
            if j not in starts.tolist():
                j -= 1  # the number starts at its sign
            assert data[j : m.start()] in (b"", b"-")
            token = ids[starts.tolist().index(j)]
            small = int(m.group()) < numbers and (m.group() == b"0" or m.group()[:1] != b"0")
            assert (token >= cot.NUMBER_BASE) == small, (text, m.group())
    wide = cot.CotFormat(numbers=10)
    assert wide.encode("3-2").tolist() == [cot.number_token(3), ord("-"), cot.number_token(2)]
    assert wide.encode("[-2]").tolist() == [ord("["), cot.number_token(-2), ord("]")]
    with pytest.raises(TypeError, match="`fmt` must be a CotFormat or None; got int"):
        cot.encode_question("A", 10)
    with pytest.raises(TypeError, match="`text` must be a str; got bytes"):
        fmt.tokens(b"12")


def test_bad_formats_are_refused_by_name():
    allowed = re.escape(f"`numbers` must be an int in [0, {cot.MAX_NUMBERS}]; got")
    with pytest.raises(ValueError, match=f"{allowed} -1"):
        cot.CotFormat(numbers=-1)
    with pytest.raises(ValueError, match=f"{allowed} {cot.MAX_NUMBERS + 1}"):
        cot.CotFormat(numbers=cot.MAX_NUMBERS + 1)
    with pytest.raises(TypeError, match=f"{allowed} True"):
        cot.CotFormat(numbers=True)
    model = EncoderDecoder(TINY, rngs=nnx.Rngs(0))  # 259 ids: bytes only
    with pytest.raises(ValueError, match=r"vocabulary of 259 ids; `fmt` \(numbers=10\) writes 278"):
        cot.Solver(model, cot.CotFormat(numbers=10))


def test_with_numbers_the_rows_and_the_roles_are_the_tokens_of_numbers():
    problems = _problems(24)
    fmt = cot.fit_format(problems, numbers=10)
    assert fmt.numbers == 10
    assert any(fmt.encode(p.solution_text()).size < len(p.solution_text()) for p in problems)
    b = cot.split_rows(jnp.asarray(cot.pack(problems, fmt)), fmt.source_len)
    for i, p in enumerate(problems):
        question = np.asarray(b.source[i, : int(b.source_lengths[i])])
        assert np.array_equal(question, fmt.encode(p.question))
        n = int(b.where[i].sum())
        assert cot.decode_tokens(np.asarray(b.target_out[i])) == (p.solution_text(), n, True)
    # Teacher-forced accuracy per role: a token is its first byte's role, counted one problem
    # at a time with the model's forward pass.
    config = dataclasses.replace(TINY, vocab_size=fmt.vocab_size)
    solver = cot.Solver(EncoderDecoder(config, rngs=nnx.Rngs(1)), fmt, batch_size=4)
    some = [p for p in problems if "-" in p.solution_text()][:5]  # one compilation each
    assert cot.reference_accuracy(solver, some) == _reference_counts(solver, some)

    # Counted per byte instead (a number right when all its bytes are), and per number with
    # negative numbers apart.
    def sign(role, text):
        return f"{role}, {'negative' if text.startswith('-') else 'other'}"

    for units, group in [(cot.CotFormat(), None), (cot.CotFormat(numbers=10), sign)]:
        got = cot.reference_accuracy(solver, some, units=units, group=group)
        assert got == _reference_counts(solver, some, units, group)
    places = [lc.ROLES.index(name.split(",")[0]) for name in got]  # in the order of ROLES
    assert "state, negative" in got and places == sorted(places)
    with pytest.raises(TypeError, match="`group` must be callable; got str"):
        cot.reference_accuracy(solver, some, group="sign")
    with pytest.raises(TypeError, match="`fmt` must be a CotFormat or None; got int"):
        cot.reference_accuracy(solver, some, units=10)


@functools.cache
def _forward(model):
    """``model(source, source_lengths, target_in)`` jitted (one compilation per target length,
    where eager dispatch compiles each operation anew at each length) on the model's state of
    the first call (the solvers here are not trained further): the same logits."""
    graphdef, state = nnx.split(model)
    call = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))
    return functools.partial(call, state)


def _reference_counts(solver, problems, units=None, group=None) -> dict[str, dict[str, int]]:
    """reference_accuracy one problem at a time, without padding; each token's role read at the
    byte where the text of the tokens before it ends. With ``units``, a unit (a token of that
    format) is right when every model token whose bytes overlap its bytes is."""
    fmt, mine, order = solver.fmt, {}, {}
    forward = _forward(solver.model)
    for p in problems:
        question = cot.encode_question(p.question, fmt)
        solution = cot.encode_solution(p.solution_text(), fmt)
        if question.size > fmt.source_len or solution.size > fmt.target_len:
            continue
        source = np.full((1, fmt.source_len), cot.PAD_ID, np.int32)
        source[0, : question.size] = question
        target_in = np.append(cot.BOS_ID, solution[:-1])[None]  # no padding at all
        logits = forward(jnp.asarray(source), jnp.asarray([question.size]),
                         jnp.asarray(target_in))  # fmt: skip
        right = np.asarray(jnp.argmax(logits[0], -1)) == solution
        text = p.solution_text()
        written, data = lc.solution_roles(text), text.encode()
        ends = np.cumsum(_token_bytes(solution[:-1]))
        spans = list(zip(np.concatenate([[0], ends[:-1]]).tolist(), ends.tolist(), strict=True))
        found = []
        if units is None:
            found = [(written[a], data[a:b], ok) for (a, b), ok in zip(spans, right, strict=False)]
        else:
            bounds = np.cumsum(_token_bytes(units.encode(text))).tolist()
            for a, b in zip([0, *bounds[:-1]], bounds, strict=True):
                ok = all(r for (x, y), r in zip(spans, right, strict=False) if x < b and y > a)
                found.append((written[a], data[a:b], ok))
        for role, piece, ok in [*found, ("answer", b"", right[-1])]:
            name = role if group is None else group(role, piece.decode(errors="replace"))
            entry = mine.setdefault(name, {"right": 0, "tokens": 0})
            entry["right"] += bool(ok)
            entry["tokens"] += 1
            order.setdefault(name, lc.ROLES.index(role))
    return {name: mine[name] for name in sorted(mine, key=order.__getitem__)}


def test_pack_refuses_what_does_not_fit():
    p = _problems()[1]
    fmt = cot.fit_format([p])
    with pytest.raises(ValueError, match=r"problem 0 \(solvability\) has a .* source_len="):
        cot.pack([p], dataclasses.replace(fmt, source_len=len(p.question) - 1))
    with pytest.raises(ValueError, match="target_len="):
        cot.pack([p], dataclasses.replace(fmt, target_len=len(p.solution_text())))
    with pytest.raises(TypeError, match=r"linalg_cot\.Problem"):
        cot.pack(["a question"], fmt)
    with pytest.raises(ValueError, match="`source_len` must be an int >= 1; got 0"):
        cot.CotFormat(0, 10)


def test_length_buckets_hold_every_problem_once_in_a_format_that_fits_it():
    problems = _problems(120)
    fmt = cot.fit_format(problems)
    buckets = cot.length_buckets(problems, fmt, source_cuts=2, target_cuts=3, min_size=6)
    assert len(buckets) >= 3
    assert sorted(i for _, idx in buckets for i in idx) == list(range(len(problems)))
    for f, idx in buckets:
        assert len(idx) >= 6 and f.source_len <= fmt.source_len and f.target_len <= fmt.target_len
        rows = cot.pack([problems[i] for i in idx], f)  # refuses a problem that does not fit
        # The format is the bucket's own: its longest question and solution, rounded up to 8
        # (a target lengthened by 8 where two formats' rows would have the same length).
        assert f.source_len - 8 < max(len(problems[i].question.encode()) for i in idx)
        assert f.target_len - 16 < max(len(problems[i].solution_text().encode()) + 1 for i in idx)
        assert rows.shape == (len(idx), f.row_len)
    lengths = cot.source_lengths([fmt] + [f for f, _ in buckets])  # row lengths tell S apart
    assert {lengths[f.row_len] for f, _ in buckets} == {f.source_len for f, _ in buckets}
    tokens = sum(len(idx) * f.row_len for f, idx in buckets)
    assert tokens < 0.9 * len(problems) * fmt.row_len  # less padding than one format's
    # One cell: one bucket of everything, in fmt's own lengths; a min_size above the count too.
    [(whole, idx)] = cot.length_buckets(problems, fmt, source_cuts=1, target_cuts=1, min_size=1)
    assert whole == fmt and idx == list(range(len(problems)))
    assert len(cot.length_buckets(problems, fmt, source_cuts=2, target_cuts=3, min_size=500)) == 1
    with pytest.raises(ValueError, match=r"`fmt` holds 8 and .*size it with fit_format"):
        cot.length_buckets(problems, dataclasses.replace(fmt, source_len=8), source_cuts=1,
                           target_cuts=1, min_size=1)  # fmt: skip
    with pytest.raises(ValueError, match="length_buckets: `source_cuts` must be an int >= 1"):
        cot.length_buckets(problems, fmt, source_cuts=0, target_cuts=1, min_size=1)
    with pytest.raises(TypeError, match="length_buckets: `fmt` must be a CotFormat"):
        cot.length_buckets(problems, (96, 64), source_cuts=1, target_cuts=1, min_size=1)
    with pytest.raises(ValueError, match="rows of length 41 would have a source of 16 and of 8"):
        cot.source_lengths([cot.CotFormat(16, 24), cot.CotFormat(8, 32)])


def test_a_buckets_rows_give_the_loss_of_the_same_problems_padded_to_the_longest():
    """Padding only to a bucket's own lengths changes no loss and no gradient (the sparse model's
    every switch on: sparsemax attention and outputs, windows, sinks, rotary positions,
    literals), and the loss reads each batch's source length from its row length."""
    problems = _problems(40)
    fmt = cot.fit_format(problems)
    cfg = dataclasses.replace(TINY, logit_scale=0.125, decoder_window=8, decoder_sinks=2,
                              decoder_block=8, positions="rotary", embed_mask="magnitude",
                              literal_tokens=cot.LITERAL_TOKENS, cross_queries="self")  # fmt: skip
    model = EncoderDecoder(cfg, rngs=nnx.Rngs(0))
    buckets = cot.length_buckets(problems, fmt, source_cuts=2, target_cuts=2, min_size=4)
    assert len(buckets) >= 2
    source_len = cot.source_lengths([fmt] + [f for f, _ in buckets])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def loss_and_grads(rows):
        return jax.value_and_grad(
            lambda p: cot.loss_fn(nnx.merge(graphdef, p, rest), rows, source_len=source_len)[0]
        )(params)

    f, idx = buckets[0]  # the shortest (the last holds the longest problem: fmt's lengths)
    chosen = [problems[i] for i in idx]
    short, padded = cot.pack(chosen, f), cot.pack(chosen, fmt)
    assert short.shape[1] < padded.shape[1]
    (a, ga), (b, gb) = loss_and_grads(jnp.asarray(short)), loss_and_grads(jnp.asarray(padded))
    np.testing.assert_allclose(a, b, rtol=2e-5)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-6)
    with pytest.raises(ValueError, match=r"rows of length 30 are not in `source_len`"):
        cot.loss_fn(model, jnp.zeros((2, 30), jnp.int32), source_len=source_len)


def test_chunked_decoder_equals_greedy_decode():
    cfg = dataclasses.replace(TINY, decoder_window=6, decoder_sinks=1)
    model = EncoderDecoder(cfg, rngs=nnx.Rngs(2))
    fmt = cot.fit_format(_problems())
    b = cot.split_rows(jnp.asarray(cot.pack(_problems()[:3], fmt)), fmt.source_len)
    want, _ = greedy_decode(model, b.source, b.source_lengths, bos=cot.BOS_ID, eos=cot.EOS_ID,
                            max_len=23)  # fmt: skip
    tokens, seconds = cot.GreedyDecoder(model, max_len=23, chunk=8)(b.source, b.source_lengths)
    assert seconds > 0 and tokens.shape[0] == 3 and tokens.shape[1] in (8, 16, 23)
    np.testing.assert_array_equal(tokens, np.asarray(want)[:, : tokens.shape[1]])
    if tokens.shape[1] < 23:  # it stopped early: every row had ended
        assert (np.asarray(want)[:, tokens.shape[1] - 1 :] == cot.EOS_ID).all()


# ---------------------------------------------------------------------------------------------
# An untrained model, unreadable questions.


@functools.cache
def _untrained() -> cot.Solver:
    model = EncoderDecoder(TINY, rngs=nnx.Rngs(0))
    return cot.Solver(model, cot.fit_format(_problems()), batch_size=2)


def test_an_untrained_model_does_not_pass():
    problems = _problems(6)
    result = cot.evaluate(_untrained(), problems)
    assert list(result["kinds"]) == ["rref", "solvability", "column_space"]
    assert result["overall"]["exact_match"] == 0.0
    assert all(r["exact_match"] == 0.0 for r in result["kinds"].values())
    assert not any(r["correct"] for r in result["records"])


LONG = "Find the reduced row echelon form R of A = [[" + ", ".join(["1"] * 60) + "]]."


@pytest.mark.parametrize(
    "question, reason",
    [
        ("", "could not parse the question: it is empty"),
        ("   \n", "could not parse the question: it is empty"),
        ("What is 2 + 2?", "could not parse the question: could not tell what the question asks"),
        (
            "Is b = [1, 2] in the column space of A = [[1, 2], [3]]?",
            "could not parse the question: the rows of the matrix A",
        ),
        (LONG, rf"the question is {len(LONG)} tokens long; this model reads at most \d+ "),
    ],
)
def test_unreadable_questions_are_answered_with_the_reason(question, reason):
    solver = _untrained()
    answer = solver.answer(question)
    assert answer.text.startswith("Cannot answer: ") and re.search(reason, answer.text)
    assert (answer.final, answer.steps, answer.tokens, answer.finished) == (None, (), 0, False)
    assert answer.error and re.search(reason, answer.error)
    # In a batch, the others are still decoded, in order.
    both = solver.answer_batch([RREF, question])
    assert both[0].error is None and both[0].kind == "rref" and both[0].tokens >= 1
    assert both[1] == answer


def test_most_frequent_answers_grades_each_kinds_most_frequent_training_answer():
    def problem(kind, answer):
        return lc.Problem(kind=kind, question="q", steps=("s",), answer=answer)

    yes, no = "yes; x = [1]", "no"
    train = [problem("column_space", a) for a in (no, yes, yes, no)]  # a tie: the first seen
    train += [problem("solvability", a) for a in ("never", "always", "always")]
    test = [problem("solvability", a) for a in ("always", "never", "always", "always")]
    test += [problem("column_space", a) for a in (no, "no ", yes)]  # grading ignores spaces
    test += [problem("rref", "[[1]]")]  # no training problem of this kind
    got = cot.most_frequent_answers(train, test)
    assert list(got) == ["rref", "solvability", "column_space", "overall"]  # KINDS order
    assert got["solvability"] == {"answer": "always", "questions": 4, "exact_match": 0.75}
    assert got["column_space"] == {"answer": no, "questions": 3, "exact_match": 2 / 3}
    assert got["rref"] == {"answer": None, "questions": 1, "exact_match": 0.0}
    assert got["overall"] == {"answer": None, "questions": 8, "exact_match": 5 / 8}
    with pytest.raises(TypeError, match="most_frequent_answers: problems must be"):
        cot.most_frequent_answers(train, ["What is rref([[1]])?"])


def test_a_question_that_is_not_a_string_is_a_type_error():
    with pytest.raises(TypeError, match="a question must be a str; got int"):
        _untrained().answer(42)
    with pytest.raises(TypeError, match="`questions` must be a sequence of str"):
        _untrained().answer_batch(RREF)


# ---------------------------------------------------------------------------------------------
# A tiny run of python -m experiments.cot: both models memorise four rref problems (both losses
# are below 0.01 by update 100 of the 150).

RUN_FLAGS = [
    "--data.kinds", "rref", "--data.train", "4", "--data.validation", "1", "--data.test", "4",
    "--model.d-model", "32", "--model.num-heads", "2", "--model.d-ff", "64",
    "--model.cot-steps", "0", "--train.steps", "150", "--train.batch-size", "4",
    "--train.lr", "1e-2", "--train.warmup", "5", "--run.checkpoint-every", "75",
]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`python -m experiments.cot train` with tiny flags; the problems it trained on."""
    from experiments import cot as experiment

    tmp = tmp_path_factory.mktemp("cot")
    folder = tmp / "run"
    args = [*RUN_FLAGS, "--run.dir", str(folder), "--run.cache-dir", str(tmp)]
    assert experiment.run(experiment.parse(["train", *args])) == folder
    generator = lc.GeneratorConfig(kinds=("rref",), **experiment.SIZES["small"])
    data = lc.prepare(tmp / "tfds", train=4, validation=1, test=4, seed=0, config=generator)
    return dict(folder=folder, args=args, train=list(data.train), test=list(data.test))


@functools.cache
def _trained(folder, name: str) -> cot.Solver:
    return cot.Solver.load(folder, name, batch_size=4)


def _independent_decode(model, fmt, questions):
    """encdec.greedy_decode (the whole length, no chunks) of each question: (text, tokens)."""
    source = np.full((len(questions), fmt.source_len), cot.PAD_ID, np.int32)
    for i, q in enumerate(questions):
        source[i, : len(q.encode())] = list(q.encode())
    lengths = np.array([len(q.encode()) for q in questions], np.int32)
    tokens, _ = greedy_decode(model, jnp.asarray(source), jnp.asarray(lengths), bos=cot.BOS_ID,
                              eos=cot.EOS_ID, max_len=fmt.target_len)  # fmt: skip
    out = []
    for row in np.asarray(tokens).tolist():
        end = row.index(cot.EOS_ID) if cot.EOS_ID in row else len(row)
        text = bytes(t for t in row[:end] if t < 256).decode("utf-8", errors="replace")
        out.append((text, min(end + 1, len(row))))
    return out


def test_solver_load_refuses_a_folder_without_a_trained_model(run, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a chain-of-thought run folder"):
        cot.Solver.load(tmp_path)
    shutil.copy(run["folder"] / cot.RECORD, tmp_path / cot.RECORD)
    with pytest.raises(FileNotFoundError, match="no trained checkpoint of the 'sparse' model"):
        cot.Solver.load(tmp_path, "sparse")
    with pytest.raises(ValueError, match=r"`model`='huge' is not a model of .*\['dense', 'spa"):
        cot.Solver.load(tmp_path, "huge")
    # An interrupted run: its checkpoint at step 75 of the 150 planned.
    shutil.copytree(run["folder"] / "checkpoints" / "sparse", tmp_path / "checkpoints" / "sparse")
    shutil.rmtree(tmp_path / "checkpoints" / "sparse" / "150")
    with pytest.raises(ValueError, match=r"trained to step 75 of 150 only .*--run\.resume"):
        cot.Solver.load(tmp_path, "sparse")
    half = cot.Solver.load(tmp_path, "sparse", partial=True)
    full = _trained(run["folder"], "sparse")
    assert (half.step, full.step) == (75, 150)
    assert not np.array_equal(half.model.head.kernel[...], full.model.head.kernel[...])


@pytest.mark.parametrize("name", ["sparse", "dense"])
def test_a_trained_solver_answers_with_its_model(run, name):
    solver = _trained(run["folder"], name)
    assert solver.step == 150 and solver.kinds == ("rref",) and solver.name == name
    questions = [p.question for p in run["train"]]
    answers = solver.answer_batch(questions, batch_size=3)  # a batch of 3, then one of 1
    want = _independent_decode(solver.model, solver.fmt, questions)
    for answer, (text, tokens) in zip(answers, want, strict=True):
        assert (answer.text, answer.tokens) == (text, tokens)
        assert (answer.steps, answer.final) == lc.split_solution(text)
        assert answer.kind == "rref" and answer.error is None and answer.seconds > 0
        assert answer.finished
    correct = [
        a.final is not None and lc.grade(a.final, p.answer)
        for a, p in zip(answers, run["train"], strict=True)
    ]
    assert sum(correct) >= 3, [a.final for a in answers]
    assert solver.answer(questions[0]).text == answers[0].text


def test_evaluate_figures_recomputed_independently(run):
    solver = _trained(run["folder"], "dense")
    fmt = solver.fmt
    others = [p for p in _problems() if p.kind != "rref"]
    problems = [*run["train"], *run["test"], *others]
    result = cot.evaluate(solver, problems, repeats=2)
    records = result["records"]
    assert [r["question"] for r in records] == [p.question for p in problems]
    # The other kinds' questions are refused: the run trained on rref only.
    fits = [p.kind in solver.kinds and len(p.question.encode()) <= fmt.source_len
            for p in problems]  # fmt: skip
    assert not all(fits)
    decoded = iter(_independent_decode(solver.model, fmt, [
        p.question for p, ok in zip(problems, fits, strict=True) if ok]))  # fmt: skip
    mine = []
    for p, ok, r in zip(problems, fits, records, strict=True):
        if not ok:
            why = "the question is" if p.kind in solver.kinds else "this model was trained on"
            assert r["error"].startswith(why) and not r["correct"]
            assert r["first_divergence"] == f"{lc.step_type(p.steps[0])}: missing"
            mine.append(dict(kind=p.kind, correct=False, tokens=0, steps=0, flops=None,
                             chain=False, first=False, fraction=0.0,
                             divergence=r["first_divergence"]))  # fmt: skip
            continue
        text, tokens = next(decoded)
        steps, final = lc.split_solution(text)
        correct = final is not None and lc.grade(final, p.answer)
        flops = solver.model.flops(len(p.question.encode()), tokens)["total"]
        # The reference's step lines written, in order, before the first that differs.
        matched = next(
            (i for i, (a, b) in enumerate(zip(steps, p.steps, strict=False)) if a != b),
            min(len(steps), len(p.steps)),
        )
        chain = correct and steps == p.steps
        assert (r["text"], r["tokens"], r["steps"], r["final"]) == (text, tokens, len(steps), final)
        assert (r["correct"], r["flops"], r["error"]) == (correct, flops, None)
        assert (r["chain_correct"], r["steps_matched"]) == (chain, matched)
        assert r["first_divergence"] == lc.first_divergence(steps, p.steps)
        mine.append(
            dict(kind=p.kind, correct=correct, tokens=tokens, steps=len(steps), flops=flops,
                 chain=chain, first=matched >= 1, fraction=matched / len(p.steps),
                 divergence=r["first_divergence"])
        )  # fmt: skip
    for kind in {p.kind for p in problems}:
        rows = [m for m in mine if m["kind"] == kind]
        refs = [p for p in problems if p.kind == kind]
        got = result["kinds"][kind]
        assert got["questions"] == len(rows)
        assert got["exact_match"] == pytest.approx(np.mean([m["correct"] for m in rows]))
        assert got["tokens"] == pytest.approx(np.mean([m["tokens"] for m in rows]))
        assert got["steps"] == pytest.approx(np.mean([m["steps"] for m in rows]))
        assert got["reference_tokens"] == pytest.approx(
            np.mean([len(p.solution_text().encode()) + 1 for p in refs]))  # fmt: skip
        assert got["reference_steps"] == pytest.approx(np.mean([len(p.steps) for p in refs]))
        for name, key in (("chain_match", "chain"), ("first_step", "first"),
                          ("steps_matched", "fraction")):  # fmt: skip
            assert got[name] == pytest.approx(np.mean([m[key] for m in rows])), name
        divergences = collections.Counter(m["divergence"] for m in rows if m["divergence"])
        assert got["divergences"] == dict(divergences)
        assert list(got["divergences"].values()) == sorted(divergences.values(), reverse=True)
        flops = [m["flops"] for m in rows if m["flops"] is not None]
        if flops:
            assert got["flops_per_question"] == pytest.approx(np.mean(flops))
        assert got["errors"] == sum(m["flops"] is None for m in rows)
    assert result["kinds"]["rref"]["exact_match"] >= 3 / 8  # its four training problems
    # ... whose chains it learned by heart: the chain figures are not all zero.
    assert result["kinds"]["rref"]["chain_match"] > 0
    assert result["kinds"]["rref"]["first_step"] >= result["kinds"]["rref"]["chain_match"]
    overall = result["overall"]
    assert overall["exact_match"] == pytest.approx(np.mean([m["correct"] for m in mine]))
    assert overall["seconds_per_question"] == pytest.approx(
        sum(r["seconds"] for r in records) / len(records))  # fmt: skip
    assert overall["seconds_per_question"] > 0
    # Softmax: every key the masks allow has a non-zero weight.
    for part in ("encoder", "decoder_self", "decoder_cross"):
        allowed = overall["attention"][f"{part}_allowed"]
        assert 0 < allowed <= 1
        assert overall["attention"][f"{part}_nonzero"] == pytest.approx(allowed, rel=1e-5)


def test_reference_accuracy_recomputed_one_problem_at_a_time(run):
    solver = _trained(run["folder"], "dense")
    fmt = solver.fmt
    others = [p for p in _problems(5) if p.kind != "rref"]  # some too long for this run
    problems = [*run["train"], *run["test"], *others]
    fits = [
        cot.encode_question(p.question).size <= fmt.source_len
        and cot.encode_solution(p.solution_text()).size <= fmt.target_len
        for p in problems
    ]
    assert not all(fits) and any(fits)
    got = cot.reference_accuracy(solver, problems, batch_size=3)  # the last batch padded
    assert got == _reference_counts(solver, problems)
    assert list(got) == [r for r in lc.ROLES if r in got]
    # It learned its four training chains by heart: the tokens of their states are right.
    learned = cot.reference_accuracy(solver, run["train"])
    assert learned["state"]["right"] / learned["state"]["tokens"] > 0.95
    # evaluate's summaries: per kind, and over all kinds the sums.
    result = cot.evaluate(solver, problems)
    total = {}
    for kind in result["kinds"]:
        counts = cot.reference_accuracy(solver, [p for p in problems if p.kind == kind])
        want = {r: {"accuracy": c["right"] / c["tokens"], "tokens": c["tokens"]}
                for r, c in counts.items()}  # fmt: skip
        assert result["kinds"][kind]["reference_roles"] == want
        for r, c in counts.items():
            right, tokens = total.get(r, (0, 0))
            total[r] = (right + c["right"], tokens + c["tokens"])
    assert result["overall"]["reference_roles"] == {
        r: {"accuracy": a / n, "tokens": n} for r, (a, n) in total.items()
    }
    with pytest.raises(TypeError, match="`solver` must be a Solver; got EncoderDecoder"):
        cot.reference_accuracy(solver.model, problems)
    with pytest.raises(ValueError, match="batch_size"):
        cot.reference_accuracy(solver, problems, batch_size=0)


def test_the_experiment_evaluates_answers_and_resumes(run, capsys, tmp_path):
    from experiments import cot as experiment
    from experiments.common import stats
    from experiments.cot.report import roles_table, write_report
    from sparse_jax.models.encdec import describe

    folder = run["folder"]
    summary = experiment.run(experiment.parse(
        ["eval", "--run.dir", str(folder), "--run.cache-dir", str(folder.parent),
         "--eval.batch-size", "4", "--eval.repeats", "1"]))  # fmt: skip
    for name in ("config.json", "cot.json", "metrics.jsonl", "training.json", "summary.json",
                 "report.md", "figure3.png", "loss.png", "answers-sparse.jsonl",
                 "answers-dense.jsonl"):  # fmt: skip
        assert (folder / name).is_file(), name
    saved = json.loads((folder / "summary.json").read_text())
    assert set(saved) >= {
        "kinds", "most_frequent_answer", "distinct_training_questions", "format", "lengths",
        "data", "models", "evaluation", "comparison", "phase_seconds", "wall_time_s", "device",
    }  # fmt: skip
    assert saved["kinds"] == ["rref"] and saved["evaluation"] == summary["evaluation"]
    assert set(saved["phase_seconds"]) == {
        "data", "train_sparse", "train_dense", "eval_sparse", "eval_dense"}  # fmt: skip
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    report = (folder / "report.md").read_text()
    em = {}
    for name in ("sparse", "dense"):
        model = saved["models"][name]
        assert model["trained_steps"] == 150
        assert [m["step"] for m in metrics if m["phase"] == name] == list(range(1, 151))
        assert sum("eval_loss" in m for m in metrics if m["phase"] == name) == 2
        assert model["switches"] == describe(EncDecConfig(**model["config"]))
        # The answers file re-graded here gives the summary's exact match.
        rows = [json.loads(line) for line in (folder / f"answers-{name}.jsonl").open()]
        assert [r["question"] for r in rows] == [p.question for p in run["test"]]
        graded = [
            (final := lc.split_solution(r["text"])[1]) is not None and lc.grade(final, p.answer)
            for r, p in zip(rows, run["test"], strict=True)
        ]
        em[name] = saved["evaluation"][name]["kinds"]["rref"]["exact_match"]
        assert em[name] == pytest.approx(np.mean(graded))
    assert saved["models"]["dense"]["switches"] == {}
    assert "normalizer" in saved["models"]["sparse"]["switches"]
    # Without --model.learn-alpha no attention has an α of its own, and the report says none.
    assert saved["models"]["sparse"]["learned_alphas"] == {} and "Learned α" not in report
    # The report says when the chains compute their rows (--data.arithmetic), and only then.
    assert "--data.arithmetic" not in report
    worked = tmp_path / "worked"
    worked.mkdir()
    write_report(worked, {**saved, "data": {**saved["data"], "arithmetic": True}})
    assert "seed 0; the chains compute each changed row's entries, --data.arithmetic)" in (
        (worked / "report.md").read_text()
    )
    data = {**saved["data"], "arithmetic": True, "products": True}
    write_report(worked, {**saved, "data": data})
    assert "--data.arithmetic, each combination's product first, --data.products)" in (
        (worked / "report.md").read_text()
    )
    assert "both models: rotary positions, cross-attention queries from the self-attention's" in (
        report
    )
    # Answering the most frequent training answer, recomputed from the training split.
    answers = collections.Counter(p.answer for p in run["train"])
    prior = np.mean([lc.grade(answers.most_common(1)[0][0], p.answer) for p in run["test"]])
    assert saved["most_frequent_answer"]["rref"]["exact_match"] == pytest.approx(prior)
    assert saved["most_frequent_answer"]["overall"]["exact_match"] == pytest.approx(prior)
    # Distinct training questions, recomputed from the parsed training split.
    distinct = len({lc.parse_question(p.question).key for p in run["train"]})
    assert saved["distinct_training_questions"] == {"rref": distinct}
    assert f"whatever the phrasing; none is a test question): rref {distinct}." in report
    chains = {}
    for name in ("sparse", "dense"):
        rows = [json.loads(line) for line in (folder / f"answers-{name}.jsonl").open()]
        chains[name] = np.mean([
            r["correct"] and lc.split_solution(r["text"])[0] == p.steps
            for r, p in zip(rows, run["test"], strict=True)])  # fmt: skip
        assert saved["evaluation"][name]["kinds"]["rref"]["chain_match"] == pytest.approx(
            chains[name])  # fmt: skip
    assert (
        f"| rref | {100 * em['sparse']:.1f}% | {100 * em['dense']:.1f}% | {100 * prior:.1f}% | "
        f"{100 * chains['sparse']:.1f}% | {100 * chains['dense']:.1f}% |"
    ) in report
    # Sparse against dense, recounted question by question from the answers files: the
    # questions only one model answers right, McNemar's exact p (binomial sums), Wilson's
    # intervals; the paired interval is experiments.common.stats' (tested against its formula
    # there).
    right = {
        name: [json.loads(line)["correct"] for line in (folder / f"answers-{name}.jsonl").open()]
        for name in ("sparse", "dense")
    }
    n = len(right["sparse"])
    pairs = ((right["sparse"], right["dense"]), (right["dense"], right["sparse"]))
    only = [sum(x and not y for x, y in zip(*pair, strict=True)) for pair in pairs]
    disagree = sum(only)
    tail = sum(math.comb(disagree, i) for i in range(min(only) + 1)) / 2**disagree
    p_value = 1.0 if only[0] == only[1] else min(1.0, 2 * tail)
    ci = [100 * x for x in stats.paired(right["sparse"], right["dense"])["ci95"]]
    for kind in ("rref", "overall"):  # one kind: the overall figures are its own
        compared = saved["comparison"][kind]
        assert [compared["only_sparse_right"], compared["only_dense_right"]] == only
        assert compared["mcnemar_p"] == pytest.approx(p_value)
        assert compared["exact_match_points_ci95"] == pytest.approx(ci)
        assert compared["exact_match_points"] == pytest.approx(100 * (only[0] - only[1]) / n)
        for name in ("sparse", "dense"):
            k, z = sum(right[name]), scipy.stats.norm.ppf(0.975)
            centre = (k + z * z / 2) / (n + z * z)
            half = z / (n + z * z) * math.sqrt(k * (n - k) / n + z * z / 4)
            assert compared["exact_match_ci95"][name] == pytest.approx(
                [centre - half, centre + half]
            )
    low, high = saved["comparison"]["rref"]["exact_match_ci95"]["sparse"]
    assert f"| rref | {100 * low:.1f}–{100 * high:.1f} | " in report
    assert f" | {only[0]} / {only[1]} | {p_value:.3f} | " in report
    # Where the chains leave the reference, recounted from the answers files.
    cells = []
    for name in ("sparse", "dense"):
        rows = [json.loads(line) for line in (folder / f"answers-{name}.jsonl").open()]
        counts = collections.Counter(
            d for r, p in zip(rows, run["test"], strict=True)
            if (d := lc.first_divergence(lc.split_solution(r["text"])[0], p.steps)))  # fmt: skip
        top = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:3]
        cells.append(f"{sum(counts.values())} of {len(rows)} differ" + "".join(
            f"{', ' if i else ': '}{label} ({n})" for i, (label, n) in enumerate(top)))  # fmt: skip
    assert f"| rref | {cells[0]} | {cells[1]} |" in report
    # Teacher-forced accuracy by role, recomputed with each trained model.
    counts = [cot.reference_accuracy(_trained(folder, n), run["test"]) for n in ("sparse", "dense")]
    roles = [r for r in lc.ROLES if r in counts[0] or r in counts[1]]
    assert roles == ["operation", "state", "answer"]  # plain chains: no terms
    assert "\n| kind | operation | state | answer |\n" in report
    accuracy = [
        " / ".join(f"{100 * c[r]['right'] / c[r]['tokens']:.1f}" for c in counts) for r in roles
    ]
    assert f"| rref | {' | '.join(accuracy)} |" in report
    # Results from before the figure: none at all gives no table, one model's gives dashes.
    older = {"overall": {}, "kinds": {"rref": {}}}
    assert roles_table({"sparse": [older], "dense": [older]}, ["rref"]) == []
    mixed = roles_table(
        {"sparse": [older], "dense": [saved["evaluation"]["dense"]]}, ["rref"])  # fmt: skip
    assert mixed[2] == "| rref | " + " | ".join(f"- / {a.split(' / ')[1]}" for a in accuracy) + " |"
    # Sparsemax leaves most allowed keys at zero weight (softmax none: see above).
    sparse = saved["evaluation"]["sparse"]["overall"]["attention"]
    for part in ("encoder", "decoder_self", "decoder_cross"):
        assert 0 < sparse[f"{part}_nonzero"] < 0.9 * sparse[f"{part}_allowed"]
    # `ask` prints each model's chain of thought, final answer and time.
    capsys.readouterr()
    question = run["train"][0].question
    answers = experiment.run(experiment.parse(["ask", question, "--run.dir", str(folder)]))
    out = capsys.readouterr().out
    for name in ("sparse", "dense"):
        answer = answers[name]
        assert answer.text == _trained(folder, name).answer(question).text
        assert f"== {name} model (trained 150 updates) ==\n{answer.text}\n" in out
        assert f"final answer: {answer.final}\n" in out
        assert re.search(rf"decoded {answer.tokens} tokens in \d+\.\d+ s", out)
    experiment.run(experiment.parse(
        ["ask", "What is 2 + 2?", "--run.dir", str(folder), "--model", "dense"]))  # fmt: skip
    out = capsys.readouterr().out
    assert "== dense model" in out and "sparse" not in out
    assert "Cannot answer: could not parse the question" in out
    # Resuming a finished run trains nothing; other flags are refused; a new run is refused.
    experiment.run(experiment.parse(["train", *run["args"], "--run.resume"]))
    assert len((folder / "metrics.jsonl").read_text().splitlines()) == len(metrics)
    with pytest.raises(
        ValueError, match=r"--run\.resume: the flags differ .*--train\.lr \(run: .*, now: 0\.02\)"
    ):
        experiment.run(experiment.parse(
            ["train", *run["args"], "--run.resume", "--train.lr", "0.02"]))  # fmt: skip
    with pytest.raises(SystemExit) as refused:
        experiment.main(["train", *run["args"]])
    assert refused.value.code == 2
    said = capsys.readouterr().err.splitlines()[-1]
    assert said.startswith("[cot] error: --run.dir ") and "already holds a run" in said, said
    # A run from before --train.buckets drew its batches in one format: it resumes as `1 1`;
    # one from before --data.arithmetic wrote no arithmetic: it resumes as --data.no-arithmetic
    # (and --data.no-products); one from before --model.numbers wrote bytes: --model.numbers 0.
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    record = json.loads((old / "config.json").read_text())
    del record["train"]["buckets"], record["data"]["arithmetic"], record["data"]["products"]
    del record["model"]["numbers"]
    (old / "config.json").write_text(json.dumps(record))
    args = [*RUN_FLAGS, "--run.dir", str(old), "--run.cache-dir", str(folder.parent),
            "--run.resume"]  # fmt: skip
    with pytest.raises(ValueError, match=r"--train\.buckets \(run: \[1, 1\], now: \[2, 3\]\)"):
        experiment.run(experiment.parse(["train", *args]))
    with pytest.raises(ValueError, match=r"--data\.arithmetic \(run: False, now: True\)"):
        experiment.run(experiment.parse(
            ["train", *args, "--train.buckets", "1", "1", "--data.arithmetic"]))  # fmt: skip
    with pytest.raises(ValueError, match=r"--model\.numbers \(run: 0, now: 10\)"):
        experiment.run(experiment.parse(
            ["train", *args, "--train.buckets", "1", "1", "--model.numbers", "10"]))  # fmt: skip
    experiment.run(experiment.parse(["train", *args, "--train.buckets", "1", "1"]))


def test_roles_counts_each_models_test_split_per_number(run, capsys, tmp_path):
    from experiments import cot as experiment

    cache = run["args"][run["args"].index("--run.cache-dir") + 1]
    flags = ["roles", "--run.dir", str(run["folder"]), "--run.cache-dir", cache]
    out = experiment.run(experiment.parse([*flags, "--numbers", "10"]))
    printed = capsys.readouterr().out
    units = cot.CotFormat(numbers=10)
    for name in ("sparse", "dense"):  # plain chains: no terms, so the groups are the roles
        solver = _trained(run["folder"], name)
        assert out[name] == cot.reference_accuracy(solver, run["test"], units=units)
    for group, c in out["sparse"].items():
        d = out["dense"][group]
        cells = [f"{x['right']} / {x['tokens']} ({100 * x['right'] / x['tokens']:.1f}%)"
                 for x in (c, d)]  # fmt: skip
        assert f"| {group} | {cells[0]} | {cells[1]} |" in printed
    assert "per number (|n| < 10)" in printed
    # A run that trained one model (seeds --models dense): that model's column only.
    one = tmp_path / "one"
    shutil.copytree(run["folder"], one, ignore=shutil.ignore_patterns("sparse"))
    flags[2] = str(one)
    assert list(experiment.run(experiment.parse(flags))) == ["dense"]
    assert "| what the unit writes | dense |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        experiment.parse([*flags, "--numbers", "-1"])
    assert "--numbers must be an int >= 0; got -1" in capsys.readouterr().err


def test_seeds_trains_each_model_at_each_seed_and_resumes(tmp_path, capsys):
    from experiments import cot as experiment

    top = tmp_path / "seeds"
    flags = [*RUN_FLAGS, "--train.steps", "30", "--run.checkpoint-every", "15",
             "--eval.batch-size", "4", "--eval.repeats", "1", "--run.cache-dir", str(tmp_path),
             "--run.dir", str(top), "--model.numbers", "10"]  # fmt: skip
    summary = experiment.run(experiment.parse(["seeds", "--seeds", "3", "0", *flags]))
    printed = capsys.readouterr().out
    generator = lc.GeneratorConfig(kinds=("rref",), **experiment.SIZES["small"])
    test = list(lc.prepare(tmp_path / "tfds", train=4, validation=1, test=4, seed=0,
                           config=generator).test)  # fmt: skip
    assert [(r["seed"], r["model"]) for r in summary["runs"]] == [
        (3, "sparse"), (3, "dense"), (0, "sparse"), (0, "dense")]  # fmt: skip
    exact, chains = {}, {"sparse": [], "dense": []}
    divergences = {"sparse": collections.Counter(), "dense": collections.Counter()}
    for r in summary["runs"]:
        folder = top / f"seed-{r['seed']}"
        config = json.loads((folder / "config.json").read_text())
        assert config["run"]["seed"] == r["seed"] and config["train"]["steps"] == 30
        solver = _trained(folder, r["model"])
        assert solver.step == 30 and solver.fmt.numbers == 10  # numbers as tokens, restored
        assert solver.model.config.vocab_size == cot.CotFormat(numbers=10).vocab_size
        rows = [json.loads(line) for line in (folder / f"answers-{r['model']}.jsonl").open()]
        assert [row["question"] for row in rows] == [p.question for p in test]
        graded = [
            (final := lc.split_solution(row["text"])[1]) is not None and lc.grade(final, p.answer)
            for row, p in zip(rows, test, strict=True)
        ]
        exact[r["seed"], r["model"]] = np.mean(graded)
        assert r["kinds"]["rref"]["exact_match"] == r["overall"]["exact_match"] == np.mean(graded)
        assert r["train_seconds"] > 0
        line = f"| {r['seed']} | {r['model']} | {100 * np.mean(graded):.1f}% |"
        assert line in printed and line in (top / "seeds.md").read_text()
        chains[r["model"]].append(np.mean([
            right and lc.split_solution(row["text"])[0] == p.steps
            for right, row, p in zip(graded, rows, test, strict=True)]))  # fmt: skip
        assert r["overall"]["chain_match"] == pytest.approx(chains[r["model"]][-1])
        divergences[r["model"]].update(
            d for row, p in zip(rows, test, strict=True)
            if (d := lc.first_divergence(lc.split_solution(row["text"])[0], p.steps)))  # fmt: skip
    cells = []  # where the chains leave the reference, summed over the seeds
    for counts in divergences.values():
        most = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:3]
        listed = "".join(f"{', ' if i else ': '}{label} ({n})" for i, (label, n) in enumerate(most))
        cells.append(f"{sum(counts.values())} of {2 * len(test)} differ{listed}")
    assert f"| rref | {cells[0]} | {cells[1]} |" in (top / "seeds.md").read_text()
    # Teacher-forced accuracy by role, the mean over the seeds, recomputed with each model.
    means = {}
    for name in ("sparse", "dense"):
        counts = [
            cot.reference_accuracy(_trained(top / f"seed-{seed}", name), test) for seed in (3, 0)
        ]
        means[name] = [f"{100 * np.mean([c[r]['right'] / c[r]['tokens'] for c in counts]):.1f}"
                       for r in ("operation", "state", "answer")]  # fmt: skip
    cells = [f"{a} / {b}" for a, b in zip(means["sparse"], means["dense"], strict=True)]
    assert "sparse / dense, the mean over the seeds:" in printed
    assert f"| overall | {' | '.join(cells)} |" in printed
    for name, values in chains.items():  # the mean row: exact match per kind, chains right
        mean = f"{100 * np.mean([exact[s, name] for s in (3, 0)]):.1f}%"
        assert f"| mean | {name} | {mean} | {mean} | {100 * np.mean(values):.1f}% | | |" in printed
    # The seed decides the weights: the two seeds' sparse models differ.
    weights = [
        jax.tree.leaves(nnx.state(_trained(top / f"seed-{seed}", "sparse").model, nnx.Param))
        for seed in (0, 3)
    ]
    assert any(not np.array_equal(a, b) for a, b in zip(*weights, strict=True))
    for name in ("sparse", "dense"):
        spread = summary["exact_match"][name]["overall"]
        mine = [exact[seed, name] for seed in (3, 0)]
        assert spread == pytest.approx(dict(mean=np.mean(mine), min=min(mine), max=max(mine)))
    gap = summary["exact_match"]["sparse_minus_dense_points"]
    for seed in (3, 0):
        want = 100 * (exact[seed, "sparse"] - exact[seed, "dense"])
        assert gap["per_seed"][str(seed)] == pytest.approx(want)
    assert f"mean {gap['mean']:+.1f} points" in printed
    # Pooled over the seeds, recounted from the answers files: the answers only one model got
    # right and the difference (the interval is experiments.common.stats', tested there).
    right = {
        (seed, name): [json.loads(line)["correct"]
                       for line in (top / f"seed-{seed}" / f"answers-{name}.jsonl").open()]
        for seed in (3, 0) for name in ("sparse", "dense")
    }  # fmt: skip
    sparse = [x for seed in (3, 0) for x in right[seed, "sparse"]]
    dense = [x for seed in (3, 0) for x in right[seed, "dense"]]
    pooled = summary["pooled"]["overall"]
    only = [sum(x and not y for x, y in zip(sparse, dense, strict=True)),
            sum(y and not x for x, y in zip(sparse, dense, strict=True))]  # fmt: skip
    assert [pooled["a_only"], pooled["b_only"], pooled["n"]] == [*only, 2 * len(test)]
    assert pooled["clusters"] == len(test)  # each question once, whatever the seeds
    assert pooled["difference"] == pytest.approx((only[0] - only[1]) / (2 * len(test)))
    assert summary["pooled"]["rref"] == pooled  # one kind: its figures are the overall ones
    lo, hi = (100 * x for x in pooled["ci95"])
    assert (
        f"| overall | {100 * pooled['difference']:+.1f} ({lo:+.1f} to {hi:+.1f}) | "
        f"{only[0]} / {only[1]} | {2 * len(test)} |"
    ) in printed
    assert json.loads((top / "seeds.json").read_text()) == json.loads(json.dumps(summary))
    # A second call on the folder is refused without --run.resume; with it, what was evaluated
    # is read back and a missing evaluation is made again, training nothing.
    with pytest.raises(SystemExit) as refused:
        experiment.main(["seeds", "--seeds", "3", "0", *flags])
    assert refused.value.code == 2
    printed = capsys.readouterr().err
    assert "already holds runs (seed-0, seed-3)" in printed and len(printed.splitlines()) == 1
    lines = {s: (top / f"seed-{s}" / "metrics.jsonl").read_text() for s in (0, 3)}
    (top / "seed-3" / "eval-dense.json").unlink()
    again = experiment.run(experiment.parse(["seeds", "--seeds", "3", "0", *flags, "--run.resume"]))
    assert {s: (top / f"seed-{s}" / "metrics.jsonl").read_text() for s in (0, 3)} == lines
    assert again["exact_match"] == summary["exact_match"]
    assert again["runs"][:1] + again["runs"][2:] == summary["runs"][:1] + summary["runs"][2:]


# ---------------------------------------------------------------------------------------------
# The command line.


def test_the_report_gives_each_attentions_learned_alpha_per_head():
    from experiments.cot.report import alpha_lines

    cfg = dataclasses.replace(TINY, learn_alpha=True, normalizer="entmax15")
    model = EncoderDecoder(cfg, rngs=nnx.Rngs(0))
    model.encoder[0].attn.alpha_logit[...] = jnp.log(jnp.expm1(jnp.array([0.25, 1.0])))
    alphas = model.learned_alphas()
    assert len(alphas) == cfg.encoder_layers + cfg.cot_steps + 2 * cfg.decoder_layers
    assert alphas["encoder.0.attn"] == [1.25, 2.0]  # the α set above; the rest start at 1.5
    assert all(v == [1.5, 1.5] for path, v in alphas.items() if path != "encoder.0.attn")
    (line,) = [x for x in alpha_lines(alphas) if x]
    assert list(alphas) == [  # in the order the model runs them
        "encoder.0.attn", "cot.0.attn", "decoder.0.self_attn", "decoder.0.cross_attn"]  # fmt: skip
    assert line.startswith("Learned α-entmax α per head") and "encoder.0.attn 1.25, 2.00;" in line
    assert all(f"{path} " in line for path in alphas)
    assert alpha_lines({}) == []


def test_the_default_command_and_the_study_preset():
    from experiments import cot as experiment

    default = experiment.parse([])
    assert isinstance(default, experiment.AllCommand) and default == experiment.AllCommand()
    assert default.data.kinds == ("rref", "solvability", "column_space")
    config = default.model.config(0)  # both models embed the literals' coordinates
    assert config.literal_tokens == cot.LITERAL_TOKENS == config.dense().literal_tokens
    assert experiment.parse(["--model.no-literals"]).model.config(0).literal_tokens is None
    # Both models: rotary positions, cross-attention queries from the self-attention.
    assert (config.positions, config.cross_queries) == ("rotary", "self")
    assert (config.dense().positions, config.dense().cross_queries) == ("rotary", "self")
    assert experiment.study().model.config(0).positions == "rotary"  # the preset's too
    old = experiment.parse(["--model.positions", "sinusoid", "--model.cross-queries", "input"])
    assert (old.model.config(0).positions, old.model.config(0).cross_queries) == (
        "sinusoid",
        "input",
    )
    study = experiment.parse(["--preset", "study", "--train.steps", "7"])
    assert isinstance(study, experiment.AllCommand) and study.data.kinds == lc.KINDS
    assert study.train.steps == 7 and study.model.d_model == 256
    assert study.model.config(0).decoder_block == 64  # the fused kernels' fastest GPU tiles
    assert experiment.parse(["train", "--preset", "study"]).data.sizes == "default"


def test_data_arithmetic_writes_the_arithmetic_into_the_splits(tmp_path):
    from experiments import cot as experiment
    from experiments.cot.run_folder import prepare_data

    flags = ["train", "--data.kinds", "rref", "--data.train", "12", "--data.validation", "2",
             "--data.test", "2"]  # fmt: skip
    plain, worked, products = (
        prepare_data(experiment.parse(args).data, tmp_path)
        for args in (flags, [*flags, "--data.arithmetic"], [*flags, "--data.arithmetic",
                                                            "--data.products"])
    )  # fmt: skip
    assert [p.question for p in worked.train] == [p.question for p in plain.train]
    assert [p.question for p in products.train] == [p.question for p in plain.train]
    config = lc.GeneratorConfig(kinds=("rref",), arithmetic=True, **experiment.SIZES["small"])
    assert list(worked.train) == list(lc.make_splits(12, 2, 2, config=config)["train"])
    config = dataclasses.replace(config, products=True)
    assert list(products.train) == list(lc.make_splits(12, 2, 2, config=config)["train"])
    assert len({worked.dataset_dir, plain.dataset_dir, products.dataset_dir}) == 3
    assert any(": [" in step for p in worked.train for step in p.steps)
    assert not any(": [" in step for p in plain.train for step in p.steps)
    assert [p.steps for p in products.train] != [p.steps for p in worked.train]


def test_the_defaults_training_split_teaches_every_kind_more_questions_than_it_tests():
    # The small sizes once allowed 90 distinct solvability questions: the test and validation
    # splits took 66 of them, and the 1,000 training solvability problems repeated the other 24.
    from experiments import cot as experiment

    data = experiment.Data()
    splits = lc.make_splits(data.train, data.validation, data.test, config=data.generator())
    train, test = (lc.distinct_questions(splits[s]) for s in ("train", "test"))
    assert set(train) == set(test) == set(data.kinds)
    for kind in data.kinds:
        assert train[kind] >= 10 * test[kind], (kind, train[kind], test[kind])


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--train.steps", "0"], "--train.steps must be an int >= 1; got 0"),
        (["--train.lr", "-1"], "--train.lr must be a number > 0; got -1.0"),
        (["--data.kinds", "rref", "eigen"], r"--data.kinds must be distinct kinds of .*'eigen'"),
        (["--data.test", "0"], "--data.test must be an int >= 1; got 0"),
        (["--data.products"], "--data.products writes the products .* needs --data.arithmetic"),
        (["--model.num-heads", "3"], "--model.num-heads: .*`num_heads`=3 must divide"),
        (["--model.embed-keep", "0"], r"--model.embed-keep: .*`embed_keep` must be in \(0, 1\]"),
        (
            ["--model.decoder-window", "None", "--model.decoder-sinks", "2"],
            "--model.decoder-sinks: .*needs a `decoder_window`",
        ),
        (["--train.batch-size", "64", "--data.train", "10"], "--train.batch-size 64 is more"),
        (["--run.resume"], "--run.resume needs the --run.dir of the run to continue"),
        (["--eval.batch-size", "0"], "--eval.batch-size must be an int >= 1; got 0"),
        (["--eval.repeats", "0"], "--eval.repeats must be an int >= 1; got 0"),
        (["--run.max-minutes", "0"], "--run.max-minutes must be a number of minutes > 0"),
        (["train", "--run.max-minutes", "nan"], "--run.max-minutes must be a number of min"),
        (["--preset", "huge"], "--preset"),
        (["--model.positions", "learned"], "--model.positions"),
        (["--model.cross-queries", "output"], "--model.cross-queries"),
        (["--model.numbers", "-2"], r"--model.numbers: .*`numbers` must be an int in \[0, "),
        (["eval"], "--run.dir is required"),
        (["eval", "--run.dir", "/nonexistent/run"], "is not a chain-of-thought run folder"),
        (["ask", "What is rref(A)?"], "--run.dir is required"),
        (["roles"], "--run.dir is required"),
        (["seeds", "--seeds", "1", "1"], r"--seeds must be distinct ints >= 0; got \[1, 1\]"),
        (["seeds", "--run.seed", "2"], "--run.seed 2: the seeds command takes its seeds from"),
        (["seeds", "--models", "dense", "dense"], "--models must be distinct models"),
    ],
)
def test_bad_flags_are_refused_before_anything_runs(flags, match, capsys):
    from experiments import cot as experiment

    with pytest.raises(SystemExit):  # tyro prints the error and exits
        experiment.parse(flags)
    printed = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert re.search(match, printed), printed
