"""The token format of the chain-of-thought task: the special ids, :class:`CotFormat` (how long
the rows are and whether a number is one token), and the question's and solution's tokens both
ways (:func:`encode_question`, :func:`encode_solution`, :func:`decode_tokens`).

A token is a UTF-8 byte (ids 0..255), one of the specials :data:`EOS_ID`, :data:`BOS_ID` and
:data:`PAD_ID`, or with :attr:`CotFormat.numbers` a whole number (:func:`number_token`, from
:data:`NUMBER_BASE` on).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from sparse_jax.data.tokenizers import ByteTokenizer
from sparse_jax.validation import check_int

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "LITERAL_TOKENS",
    "MAX_NUMBERS",
    "NUMBER_BASE",
    "PAD_ID",
    "VOCAB_SIZE",
    "CotFormat",
    "decode_tokens",
    "encode_question",
    "encode_solution",
    "number_token",
]

EOS_ID = ByteTokenizer.eos_id  # 256: ends a solution (the byte tokenizer's end of text)
BOS_ID = 257  # the decoder's first input
PAD_ID = 258  # fills rows after a question or a solution
VOCAB_SIZE = 259  # bytes 0..255 and the three above (EncDecConfig's default 260 holds them)
# With CotFormat.numbers, the integer n is the one token number_token(n), from NUMBER_BASE on.
NUMBER_BASE = VOCAB_SIZE
MAX_NUMBERS = 100_000  # the largest CotFormat.numbers
# A decimal number, with its minus sign unless that follows what a subtraction follows (a
# digit, a letter or a closing bracket: "3-2" and "R2-1" subtract, "[-1" and "=-5" do not).
_NUMBER = re.compile(rb"(?:(?<![0-9A-Za-z)\]])-)?[0-9]+")
# The ids of "[", "]" and "," (bytes): EncDecConfig.literal_tokens for matrices and vectors.
LITERAL_TOKENS = tuple(b"[],")


@dataclasses.dataclass(frozen=True)
class CotFormat:
    """How the token rows are written: how long they are, what a model reads and writes at
    most, and whether a number is one token.

    With ``numbers = N > 0`` every integer ``-N < n < N`` written in decimal (digits without a
    leading zero, after a minus sign unless the minus subtracts: ``7``, ``-12``, the ``1`` of
    ``R1``; the ``-`` of ``3-2`` or ``R2-1`` stays a byte) is one token instead of its bytes,
    so that a model writes a computed entry in one choice (:func:`number_token`). Larger
    numbers, and digits with a leading zero, stay bytes; a fraction ``p/q`` is two numbers and
    its ``/``. ``N = 0`` (the default): every byte a token.

    Example:
      >>> CotFormat(source_len=152, target_len=272).row_len  # S + T + 1
      425
      >>> fmt = CotFormat(numbers=100)
      >>> fmt.vocab_size, fmt.encode("-12/7").tolist()  # -12, "/", 7
      (458, [282, 47, 273])
      >>> fmt.encode("3-2").tolist()  # 3, "-", 2: a subtraction
      [265, 45, 263]
    """

    source_len: int = 192  # S: question tokens the encoder reads at most
    target_len: int = 320  # T: solution tokens plus the EOS the decoder writes at most
    numbers: int = 0  # N: each integer -N < n < N one token (0: every byte a token)

    def __post_init__(self):
        check_int(self.source_len, "source_len", "CotFormat")
        check_int(self.target_len, "target_len", "CotFormat", low=2)
        check_int(self.numbers, "numbers", "CotFormat", low=0, high=MAX_NUMBERS)

    @property
    def row_len(self) -> int:
        """``S + T + 1``: a packed row (question, then BOS, solution and EOS)."""
        return self.source_len + self.target_len + 1

    @property
    def vocab_size(self) -> int:
        """The ids a model of this format reads and writes: bytes, specials and numbers."""
        return VOCAB_SIZE + max(2 * self.numbers - 1, 0)

    def tokens(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids [n], starts [n])``: ``text``'s token ids (no specials) and the offset of the
        UTF-8 byte each starts at (a number's first digit; otherwise the byte itself).

        Example:
          >>> ids, starts = CotFormat(numbers=10).tokens("R2 = -1, 15")
          >>> ids.tolist()  # R, 2, " = ", -1, ", ", then 15's digits (15 is not below 10)
          [82, 263, 32, 61, 32, 260, 44, 32, 49, 53]
          >>> starts.tolist()  # -1 starts at its sign
          [0, 1, 2, 3, 4, 5, 7, 8, 9, 10]
        """
        if not isinstance(text, str):
            raise TypeError(f"CotFormat.tokens: `text` must be a str; got {type(text).__name__}")
        data = text.encode("utf-8")
        ids = np.frombuffer(data, np.uint8).astype(np.int32)
        starts = np.arange(len(data), dtype=np.int32)
        if not self.numbers:
            return ids, starts
        keep = np.ones(len(data), bool)
        widest = len(str(self.numbers - 1))
        for run in _NUMBER.finditer(data):
            first, signed = run.start(), run.group()[:1] == b"-"
            digits = run.group()[1:] if signed else run.group()
            if len(digits) > widest or (len(digits) > 1 and digits[:1] == b"0"):
                continue  # too long, or a leading zero: bytes
            value = int(digits)
            if value >= self.numbers:
                continue
            if signed and value == 0:  # "-0": the minus a byte, then the number 0
                first += 1
            ids[first] = number_token(-value if signed else value)
            keep[first + 1 : run.end()] = False
        return ids[keep], starts[keep]

    def encode(self, text: str) -> np.ndarray:
        """``text``'s token ids, int32 ``[len]`` (no specials): a question as the encoder
        reads it.

        Example:
          >>> CotFormat().encode("A = [[1]]").tolist()[:3]
          [65, 32, 61]
        """
        return self.tokens(text)[0]


def number_token(n: int) -> int:
    """The token of the integer ``n`` when numbers are tokens (:attr:`CotFormat.numbers`):
    ``NUMBER_BASE + 2n`` for ``n >= 0``, ``NUMBER_BASE - 2n - 1`` for ``n < 0``, so that the
    numbers ``-N < n < N`` fill the ``2N - 1`` ids after the bytes and specials and any
    format's ids decode alike (:func:`decode_tokens`).

    Example:
      >>> [number_token(n) - NUMBER_BASE for n in (0, -1, 1, -2, 2)]
      [0, 1, 2, 3, 4]
    """
    n = int(n)
    return NUMBER_BASE + (2 * n if n >= 0 else -2 * n - 1)


def encode_question(question: str, fmt: CotFormat | None = None) -> np.ndarray:
    """The question's token ids in ``fmt`` (default: ``CotFormat()``, its UTF-8 bytes) as int32
    ``[len]`` (no specials).

    Example:
      >>> encode_question("A = [[1]]").tolist()[:3]
      [65, 32, 61]
    """
    if not isinstance(question, str):
        raise TypeError(f"encode_question: `question` must be a str; got {type(question).__name__}")
    return check_format(fmt, "encode_question").encode(question)


def encode_solution(solution: str, fmt: CotFormat | None = None) -> np.ndarray:
    """The solution's token ids in ``fmt`` (default: its bytes) then :data:`EOS_ID`, int32
    ``[len + 1]`` (the decoder's target; its input is ``BOS`` and all but the last).

    Example:
      >>> encode_solution("Answer: no").tolist()[-3:]
      [110, 111, 256]
      >>> encode_solution("x = 12", CotFormat(numbers=16)).tolist()  # 12 is one token
      [120, 32, 61, 32, 283, 256]
    """
    if not isinstance(solution, str):
        raise TypeError(f"encode_solution: `solution` must be a str; got {type(solution).__name__}")
    ids = check_format(fmt, "encode_solution").encode(solution)
    return np.append(ids, np.int32(EOS_ID)).astype(np.int32)


def check_format(fmt: Any, caller: str) -> CotFormat:
    """``fmt``, or for None the default format (every byte a token); a ``TypeError`` naming
    ``caller`` for anything else.

    Example:
      >>> check_format(None, "encode_question")
      CotFormat(source_len=192, target_len=320, numbers=0)
      >>> check_format("bytes", "pack")
      Traceback (most recent call last):
      ...
      TypeError: pack: `fmt` must be a CotFormat or None; got str
    """
    if fmt is None:
        return _BYTES
    if not isinstance(fmt, CotFormat):
        raise TypeError(f"{caller}: `fmt` must be a CotFormat or None; got {type(fmt).__name__}")
    return fmt


_BYTES = CotFormat()


def decode_tokens(ids: Sequence[int] | np.ndarray) -> tuple[str, int, bool]:
    """``(text, tokens, finished)`` of decoded ids: the text before the first EOS (bytes, and
    the numbers of ids from :data:`NUMBER_BASE` on written in decimal; BOS and PAD dropped,
    invalid UTF-8 as U+FFFD), the tokens up to and including that EOS (all of them without
    one), and whether there was one. Any format's ids decode so.

    Example:
      >>> decode_tokens(np.append(encode_solution("Answer: no"), [EOS_ID, EOS_ID]))
      ('Answer: no', 11, True)
      >>> decode_tokens([65, 110, 115])  # cut short: no EOS
      ('Ans', 3, False)
      >>> decode_tokens(encode_solution("x = -12", CotFormat(numbers=16)))
      ('x = -12', 6, True)
    """
    arr = np.asarray(ids).reshape(-1)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"decode_tokens: `ids` must be integers; got dtype {arr.dtype}")
    ends = np.flatnonzero(arr == EOS_ID)
    finished = bool(ends.size)
    body = arr[: ends[0]] if finished else arr
    data = bytearray()
    for i in body[(body >= 0) & ((body < EOS_ID) | (body >= NUMBER_BASE))].tolist():
        if i < NUMBER_BASE:
            data.append(i)
        else:  # number_token's inverse
            k = i - NUMBER_BASE
            data += str(k // 2 if k % 2 == 0 else -(k + 1) // 2).encode()
    count = int(ends[0] + 1 if finished else arr.size)
    return data.decode("utf-8", errors="replace"), count, finished


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` at or above ``n``.

    Example:
      >>> round_up(81, 8), round_up(80, 8)
      (88, 80)
    """
    return -(-n // multiple) * multiple
