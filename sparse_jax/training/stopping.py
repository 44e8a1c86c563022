"""Ending a training run early at a checkpoint: a time limit, or a signal from outside.

A run that must end before its last update (a Colab or Slurm time limit, a preempted TPU VM
or spot GPU, which get SIGTERM and a short grace period, ``timeout``, Ctrl-C, a notebook's
interrupt button) should save where it stands and stop, so that resuming loses nothing. A
:class:`StopRequest` turns those events into one question the trainer asks between updates
(``Trainer.fit(..., stop=request)``); when it says yes the trainer fetches the step's
metrics, saves a checkpoint of that step and returns (``trainer.step < config.steps`` then
says it ended early). On several processes the trainer asks at its logging steps and stops
when any process was asked to, so all save the same step.

Example:
  >>> import signal
  >>> with StopRequest(seconds=3600) as stop:  # handlers for SIGTERM and SIGINT installed
  ...     before = stop()
  ...     signal.raise_signal(signal.SIGTERM)  # what a scheduler sends before it kills
  ...     after = stop()
  >>> before, after, stop.reason
  (False, True, 'SIGTERM')
  >>> signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handlers are restored on exit
  True
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType

__all__ = ["StopRequest"]


class StopRequest:
    """Whether training should stop now: after ``seconds`` of wall time from entering the
    context, or once one of ``signals`` has arrived. Calling it answers (``bool``); ``reason``
    says why (``None`` while not requested).

    Within the ``with`` block the signals are caught instead of ending the process; a second
    signal while a stop is pending is passed on to the handler that was there before (the
    default: SIGTERM ends the process, SIGINT raises ``KeyboardInterrupt``), so pressing
    Ctrl-C twice still interrupts at once. Handlers can only be installed in the main thread;
    elsewhere only the time limit applies. On exit the previous handlers come back.

    Args:
      seconds: the wall-clock budget (a finite number > 0), or ``None`` for none.
      signals: the signals that request a stop (default SIGTERM and SIGINT).
      notify: called with the reason when a signal requests the stop (e.g. to print that the
        run will save and stop), from the signal handler: keep it short.

    Example:
      >>> with StopRequest(seconds=1e-9) as stop:  # a budget already spent
      ...     stop(), stop.reason
      (True, 'the time limit (1e-09 s)')
      >>> StopRequest(seconds=0)
      Traceback (most recent call last):
      ...
      ValueError: StopRequest: `seconds` must be a finite number > 0 or None; got 0
    """

    def __init__(
        self,
        seconds: float | None = None,
        *,
        signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
        notify: Callable[[str], None] | None = None,
    ):
        if seconds is not None and (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not (math.isfinite(seconds) and seconds > 0)
        ):
            raise ValueError(
                f"StopRequest: `seconds` must be a finite number > 0 or None; got {seconds!r}"
            )
        self.seconds = seconds
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.notify = notify
        self.reason: str | None = None
        self._deadline: float | None = None
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> StopRequest:
        self.reason = None
        if self.seconds is not None:
            self._deadline = time.monotonic() + self.seconds
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc_info) -> None:
        self._restore()
        self._deadline = None

    def __call__(self) -> bool:
        if self.reason is None and self._deadline is not None:
            if time.monotonic() >= self._deadline:
                self.reason = f"the time limit ({self.seconds:g} s)"
        return self.reason is not None

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            # None: a handler installed from C, which Python cannot reinstate.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.reason is not None and self.reason.startswith("SIG"):  # a second signal
            previous = self._previous.get(sig, signal.SIG_DFL)
            self._restore()
            if callable(previous):
                previous(signum, frame)
            else:
                signal.raise_signal(sig)  # SIG_DFL again: the signal does what it always did
            return
        self.reason = sig.name
        if self.notify is not None:
            self.notify(sig.name)
