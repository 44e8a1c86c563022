"""Token windows and batches: a tokenized stream (:func:`token_stream`) cut into windows of
``seq_len + 1`` tokens (:func:`make_windows`), and the deterministic, resumable iterators that
draw batches from anything with random access (:class:`BatchIterator`) or from buckets of rows of
their own lengths (:class:`BucketIterator`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from sparse_jax.data.tokenizers import Tokenizer
from sparse_jax.validation import check_bool, check_int

__all__ = [
    "BatchIterator",
    "BucketIterator",
    "RandomAccess",
    "make_windows",
    "token_stream",
]


def token_stream(documents: Iterable[str], tokenizer: Tokenizer, *, chunk: int = 256) -> np.ndarray:
    """Every document's tokens followed by ``tokenizer.eos_id``, concatenated (int32, 1-D).

    >>> from sparse_jax.data.tokenizers import ByteTokenizer
    >>> token_stream(["ab", "c"], ByteTokenizer()).tolist()
    [97, 98, 256, 99, 256]
    """
    if tokenizer.vocab_size > np.iinfo(np.int32).max:
        raise ValueError(f"tokenizer.vocab_size {tokenizer.vocab_size} does not fit in int32")
    eos = np.asarray([tokenizer.eos_id], np.int32)
    pieces: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer.encode_batch(batch):
            pieces.append(np.asarray(ids, np.int32))
            pieces.append(eos)
        batch.clear()

    for doc in documents:
        batch.append(doc)
        if len(batch) >= chunk:
            flush()
    flush()
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def make_windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows of ``seq_len + 1`` tokens with stride ``seq_len`` (a read-only view).

    Window ``i`` is ``tokens[i * seq_len : i * seq_len + seq_len + 1]``; the tail that does not
    fill a window is dropped.

    >>> make_windows(np.arange(10), 3).tolist()
    [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    """
    seq_len = check_int(seq_len, "seq_len", "make_windows")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.shape[0] < seq_len + 1:
        raise ValueError(
            f"seq_len {seq_len} needs at least seq_len + 1 = {seq_len + 1} tokens for one window, "
            f"got {tokens.shape[0]}"
        )
    return np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)[::seq_len]


class RandomAccess(Protocol):
    """What :class:`BatchIterator` draws from: a length and integer indexing.

    Example (a :class:`~sparse_jax.data.text.storage.WindowSource`, an array
    ``[n, seq_len + 1]``, or any object like this):

      >>> class Squares:
      ...     def __len__(self):
      ...         return 4
      ...
      ...     def __getitem__(self, index):
      ...         return np.full(3, index * index, np.int32)
      >>> next(BatchIterator(Squares(), batch_size=2, shuffle=False)).tolist()  # [2, 3]
      [[0, 0, 0], [1, 1, 1]]
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class _EpochPosition:
    """What :class:`BatchIterator` and :class:`BucketIterator` share: global step ``g`` is step
    ``g % steps_per_epoch`` of epoch ``g // steps_per_epoch``, and the state keys of that."""

    _global_step: int
    seed: int
    batch_size: int
    steps_per_epoch: int

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, step)`` of the next batch."""
        return divmod(self._global_step, self.steps_per_epoch)

    def _state(self, **more: Any) -> dict[str, Any]:
        epoch, step = self.position
        return {
            "epoch": epoch,
            "step": step,
            "global_step": self._global_step,
            "seed": self.seed,
            "batch_size": self.batch_size,
            **more,
        }


class BatchIterator(_EpochPosition):
    """Deterministic, resumable batches of windows: int32 ``[batch_size // process_count, L]``.

    Global step ``g`` is step ``g % steps_per_epoch`` of epoch ``g // steps_per_epoch``. Epoch
    ``e`` visits the examples in the order ``np.random.default_rng([seed, e]).permutation(n)``
    (``shuffle=True``) or in order; its step ``s`` is the global batch of positions
    ``s * batch_size : (s + 1) * batch_size`` of that order. With ``drop_remainder`` the last
    incomplete batch of an epoch is skipped, otherwise it is yielded shorter.

    Multi-host: process ``p`` of ``process_count`` yields rows ``p * b : (p + 1) * b`` of each
    global batch (``b = batch_size // process_count``), so the processes together see exactly
    the single-process batch. ``state()`` does not depend on the process layout.

    The iterator runs for ``num_epochs`` epochs (None: forever). :meth:`state` is a small
    JSON-serializable dict; :meth:`from_state` continues exactly where it was taken.

    >>> data = np.arange(10)[:, None] * np.ones((1, 3), np.int32)
    >>> it = BatchIterator(data, batch_size=4, seed=1)
    >>> [b[:, 0].tolist() for b in (next(it), next(it), next(it))]
    [[8, 4, 7, 0], [1, 2, 5, 9], [7, 2, 4, 6]]
    >>> state = it.state(); state["epoch"], state["step"]
    (1, 1)
    >>> next(BatchIterator.from_state(data, state))[:, 0].tolist() == next(it)[:, 0].tolist()
    True
    """

    def __init__(
        self,
        source: RandomAccess,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_remainder: bool = True,
        start_step: int = 0,
        num_epochs: int | None = None,
        process_index: int = 0,
        process_count: int = 1,
    ):
        if not hasattr(source, "__len__") or not hasattr(source, "__getitem__"):
            raise TypeError(
                "source must support len() and integer indexing (a WindowSource or an array "
                f"[n, seq_len + 1]), got {type(source).__name__}"
            )
        self.source = source
        self.num_examples = len(source)
        self.batch_size = check_int(batch_size, "batch_size", "BatchIterator", low=1)
        self.seed = check_int(seed, "seed", "BatchIterator", low=0)
        self.shuffle = check_bool(shuffle, "shuffle", "BatchIterator")
        self.drop_remainder = check_bool(drop_remainder, "drop_remainder", "BatchIterator")
        self.num_epochs = (
            None
            if num_epochs is None
            else check_int(num_epochs, "num_epochs", "BatchIterator", low=1)
        )
        self.process_count = check_int(process_count, "process_count", "BatchIterator", low=1)
        self.process_index = check_int(process_index, "process_index", "BatchIterator", low=0)
        if self.process_index >= self.process_count:
            raise ValueError(
                f"process_index must lie in [0, process_count = {self.process_count}), got "
                f"{self.process_index}"
            )
        if self.num_examples == 0:
            raise ValueError("source is empty: it has no examples to batch")
        if self.batch_size > self.num_examples:
            raise ValueError(
                f"batch_size {self.batch_size} is larger than the number of examples "
                f"({self.num_examples} windows): use a smaller batch_size, a smaller seq_len or "
                "a larger corpus"
            )
        if self.batch_size % self.process_count:
            raise ValueError(
                f"batch_size {self.batch_size} (the global batch) must be divisible by "
                f"process_count {self.process_count}"
            )
        self._global_step = check_int(start_step, "start_step", "BatchIterator", low=0)
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch."""
        if self.drop_remainder:
            return self.num_examples // self.batch_size
        return -(-self.num_examples // self.batch_size)

    def state(self) -> dict[str, Any]:
        """Where the iterator is (the next batch) and how it draws: plain ints and bools."""
        return self._state(
            shuffle=self.shuffle,
            drop_remainder=self.drop_remainder,
            num_epochs=self.num_epochs,
            num_examples=self.num_examples,
        )

    @classmethod
    def from_state(
        cls,
        source: RandomAccess,
        state: Mapping[str, Any],
        *,
        process_index: int = 0,
        process_count: int = 1,
    ) -> BatchIterator:
        """The iterator that :meth:`state` described, continuing with its next batch."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict from BatchIterator.state(), got {state!r:.80}")
        missing = {"global_step", "seed", "batch_size", "shuffle", "drop_remainder"} - set(state)
        if missing:
            raise ValueError(f"state lacks the keys {sorted(missing)}: got {sorted(state)}")
        n = state.get("num_examples")
        if n is not None and n != len(source):
            raise ValueError(
                f"state was taken on a source of {n} examples, but source has {len(source)}: "
                "resume on the same prepared data"
            )
        return cls(
            source,
            state["batch_size"],
            seed=state["seed"],
            shuffle=state["shuffle"],
            drop_remainder=state["drop_remainder"],
            start_step=state["global_step"],
            num_epochs=state.get("num_epochs"),
            process_index=process_index,
            process_count=process_count,
        )

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order in which epoch ``epoch`` visits the examples."""
        epoch = check_int(epoch, "epoch", "BatchIterator", low=0)
        if epoch != self._perm_epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(
                    self.num_examples
                )
            else:
                self._perm = np.arange(self.num_examples)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def indices(self, global_step: int) -> np.ndarray:
        """Example indices of this process's part of the batch at ``global_step``."""
        epoch, step = divmod(
            check_int(global_step, "global_step", "BatchIterator", low=0), self.steps_per_epoch
        )
        rows = self.epoch_order(epoch)[step * self.batch_size : (step + 1) * self.batch_size]
        if self.process_count == 1:
            return rows
        if rows.shape[0] == self.batch_size:
            b = self.batch_size // self.process_count
            return rows[self.process_index * b : (self.process_index + 1) * b]
        return np.array_split(rows, self.process_count)[self.process_index]

    def _read(self, idx: np.ndarray) -> np.ndarray:
        src = self.source
        if isinstance(src, np.ndarray):
            return np.asarray(src[idx], np.int32)
        if hasattr(src, "__getitems__"):
            out = src.__getitems__(idx.tolist())
            if not isinstance(out, np.ndarray):
                out = np.stack([np.asarray(x) for x in out])
            return out.astype(np.int32, copy=False)
        return np.stack([np.asarray(src[int(i)], np.int32) for i in idx])

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> np.ndarray:
        if self.num_epochs is not None and self.position[0] >= self.num_epochs:
            raise StopIteration
        batch = self._read(self.indices(self._global_step))
        self._global_step += 1
        return batch


class BucketIterator(_EpochPosition):
    """Deterministic, resumable batches from buckets of rows of their own lengths: each batch
    is ``[batch_size, L_b]`` rows of one bucket ``b`` (e.g. examples padded only to the longest
    of their bucket, so that short ones cost less: see ``sparse_jax.cot.length_buckets``).

    Epoch ``e`` draws from ``np.random.default_rng([seed, e])``: each bucket's rows in a random
    order, cut into batches of ``batch_size`` (a bucket's last incomplete batch is skipped,
    other rows each epoch), then all buckets' batches in a random order, so that the buckets
    take turns in proportion to their sizes. Global step ``g`` is step ``g % steps_per_epoch``
    of epoch ``g // steps_per_epoch``; :meth:`state` is a small JSON-serializable dict and
    :meth:`from_state` continues exactly where it was taken. One process (the experiments that
    use it train on one).

    >>> short = np.zeros((5, 3), np.int32); long = np.ones((6, 8), np.int32)
    >>> it = BucketIterator([short, long], batch_size=2, seed=0)
    >>> it.steps_per_epoch  # 5 // 2 + 6 // 2
    5
    >>> sorted(next(it).shape[1] for _ in range(5))  # an epoch: 2 short batches, 3 long ones
    [3, 3, 8, 8, 8]
    >>> state = it.state(); state["epoch"], state["step"]
    (1, 0)
    >>> resumed = BucketIterator.from_state([short, long], state)
    >>> np.array_equal(next(resumed), next(it))
    True
    """

    def __init__(
        self,
        buckets: Sequence[np.ndarray],
        batch_size: int,
        *,
        seed: int = 0,
        start_step: int = 0,
    ):
        if isinstance(buckets, np.ndarray) or not isinstance(buckets, Sequence) or not buckets:
            raise TypeError(
                "BucketIterator: `buckets` must be a non-empty list of arrays [n_b, L_b] (one "
                f"per bucket); got {type(buckets).__name__}"
            )
        arrays = []
        for b, rows in enumerate(buckets):
            if not isinstance(rows, np.ndarray) or rows.ndim != 2:
                raise TypeError(
                    f"BucketIterator: bucket {b} must be a 2-D array [n_b, L_b]; got "
                    f"{getattr(rows, 'shape', type(rows).__name__)}"
                )
            arrays.append(rows)
        self.buckets = arrays
        self.batch_size = check_int(batch_size, "batch_size", "BucketIterator", low=1)
        self.seed = check_int(seed, "seed", "BucketIterator", low=0)
        small = [b for b, rows in enumerate(arrays) if rows.shape[0] < self.batch_size]
        if small:
            sizes = [arrays[b].shape[0] for b in small]
            raise ValueError(
                f"BucketIterator: buckets {small} hold {sizes} rows, fewer than batch_size "
                f"{self.batch_size}: they would never be drawn; merge them into others"
            )
        self._global_step = check_int(start_step, "start_step", "BucketIterator", low=0)
        self._epoch = -1
        self._order: list[tuple[int, np.ndarray]] = []

    @property
    def bucket_sizes(self) -> list[int]:
        """Rows in each bucket."""
        return [int(rows.shape[0]) for rows in self.buckets]

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch: ``sum(n_b // batch_size)``."""
        return sum(n // self.batch_size for n in self.bucket_sizes)

    def state(self) -> dict[str, Any]:
        """Where the iterator is (the next batch) and how it draws: plain ints."""
        return self._state(bucket_sizes=self.bucket_sizes)

    @classmethod
    def from_state(cls, buckets: Sequence[np.ndarray], state: Mapping[str, Any]) -> BucketIterator:
        """The iterator that :meth:`state` described, continuing with its next batch."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict from BucketIterator.state(), got {state!r:.80}")
        missing = {"global_step", "seed", "batch_size", "bucket_sizes"} - set(state)
        if missing:
            raise ValueError(f"state lacks the keys {sorted(missing)}: got {sorted(state)}")
        it = cls(buckets, state["batch_size"], seed=state["seed"], start_step=state["global_step"])
        if list(state["bucket_sizes"]) != it.bucket_sizes:
            raise ValueError(
                f"state was taken on buckets of {list(state['bucket_sizes'])} rows, but buckets "
                f"hold {it.bucket_sizes}: resume on the same prepared data and buckets"
            )
        return it

    def epoch_batches(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """Epoch ``epoch``'s batches in order, each ``(bucket, row indices in that bucket)``."""
        epoch = check_int(epoch, "epoch", "BucketIterator", low=0)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            batches = []
            for b, n in enumerate(self.bucket_sizes):
                order = rng.permutation(n)
                size = self.batch_size
                batches += [(b, order[s * size : (s + 1) * size]) for s in range(n // size)]
            self._order = [batches[i] for i in rng.permutation(len(batches))]
            self._epoch = epoch
        return self._order

    def __iter__(self) -> BucketIterator:
        return self

    def __next__(self) -> np.ndarray:
        epoch, step = self.position
        bucket, idx = self.epoch_batches(epoch)[step]
        self._global_step += 1
        return np.asarray(self.buckets[bucket][idx], np.int32)
