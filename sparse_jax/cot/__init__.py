"""The chain-of-thought model as an API: ``Solver.load(run).answer(question)``.

The linear-algebra task (:mod:`sparse_jax.data.linalg_cot`) for the encoder–decoder
(:mod:`sparse_jax.models.encdec`) as tokens: the question's tokens are the encoder's input
(``source [B, S]``, padded with :data:`PAD_ID`, with ``source_lengths [B]``), and the worked
solution (:meth:`~sparse_jax.data.linalg_cot.Problem.solution_text`: the steps, then
``Answer: ...``) is the decoder's, between :data:`BOS_ID` and :data:`EOS_ID` (the byte
tokenizer's end-of-text id). A token is a UTF-8 byte, or with :attr:`CotFormat.numbers` a
whole number. :class:`CotFormat` fixes that and ``S`` and ``T`` (the longest question and
solution, plus the EOS, that a model reads and writes); nothing is cut to fit it: a problem
that does not fit is refused by :func:`pack` and by the :class:`Solver`.

* :func:`pack` writes problems as rows ``[S + T + 1]`` (question, then ``BOS, solution, EOS``,
  padded): one int array per batch for :class:`sparse_jax.training.loop.Trainer`;
  :func:`split_rows` takes a batch of rows apart again (pure, jittable) and :func:`loss_fn` is
  the trainer's loss (:func:`~sparse_jax.models.encdec.sequence_loss`).
* :class:`GreedyDecoder` is :func:`~sparse_jax.models.encdec.greedy_decode` (the same steps
  on the model's key/value cache) run ``chunk`` positions at a time, stopping once every row
  has emitted EOS, compiled ahead of time per batch shape: its wall time is the decoding's,
  proportional to the chain of thought it writes, without compilation.
* :class:`Solver` answers questions with a trained model (never the symbolic solver) as
  :class:`Answer`; :meth:`Solver.load` restores one from a run folder that
  ``python -m experiments.cot`` wrote (its :data:`RECORD` file and Orbax checkpoints).
* :func:`evaluate` decodes a split and measures, per kind, exact match of the final answer
  (:func:`~sparse_jax.data.linalg_cot.grade`), the chain of thought's length in steps and
  tokens, decoding seconds per question, attention density and FLOPs.

Example:
  >>> from flax import nnx
  >>> from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder
  >>> cfg = EncDecConfig(vocab_size=VOCAB_SIZE, d_model=16, num_heads=2, d_ff=32, cot_steps=0)
  >>> solver = Solver(EncoderDecoder(cfg, rngs=nnx.Rngs(0)), CotFormat(96, 64))
  >>> print(solver.answer("What is 2 + 2?").text)  # not a linear-algebra question
  Cannot answer: could not parse the question: could not tell what the question asks: ...
  >>> answer = solver.answer("Find the reduced row echelon form R of A = [[2, 4], [1, 3]].")
  >>> answer.kind, answer.error, 1 <= answer.tokens <= 64  # an untrained model's guess
  ('rref', None, True)
"""

from sparse_jax.cot.batches import (
    Batch,
    fit_format,
    length_buckets,
    loss_fn,
    pack,
    source_lengths,
    split_rows,
)
from sparse_jax.cot.decode import Answer, GreedyDecoder, Solver
from sparse_jax.cot.evaluation import evaluate, most_frequent_answers, reference_accuracy
from sparse_jax.cot.format import (
    BOS_ID,
    EOS_ID,
    LITERAL_TOKENS,
    MAX_NUMBERS,
    NUMBER_BASE,
    PAD_ID,
    VOCAB_SIZE,
    CotFormat,
    decode_tokens,
    encode_question,
    encode_solution,
    number_token,
)
from sparse_jax.cot.record import RECORD, read_record, write_record

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "LITERAL_TOKENS",
    "MAX_NUMBERS",
    "NUMBER_BASE",
    "PAD_ID",
    "RECORD",
    "VOCAB_SIZE",
    "Answer",
    "Batch",
    "CotFormat",
    "GreedyDecoder",
    "Solver",
    "decode_tokens",
    "encode_question",
    "encode_solution",
    "evaluate",
    "fit_format",
    "length_buckets",
    "loss_fn",
    "most_frequent_answers",
    "number_token",
    "pack",
    "read_record",
    "reference_accuracy",
    "source_lengths",
    "split_rows",
    "write_record",
]
