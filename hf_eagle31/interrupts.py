"""State a call lends a user's model or thread, made and undone whole even when Ctrl-C arrives.

An EAGLE call switches the target's attention to EAGLE's, a `hold_products` block holds products
beside the model, and a forward on those products pushes a torch function mode and marks them this
thread's. Each is a change with an undo, and `Held` is the one way they are made: a KeyboardInterrupt
raised halfway through making or undoing one would leave the model or the thread half switched.

Python delivers SIGINT to the main thread by running the handler at the next "eval breaker" check
(a function's first instruction, a backward jump, after a call). `Held` installs a handler that, while
a change is being made or undone, only records the signal; once the change is whole it passes the
signal to the handler that was there before (Python's KeyboardInterrupt, or the user's own, or
nothing for SIG_IGN). The one check between a block's body and the undo is at the first instruction
of `Held.__exit__`: the handler recognises that frame. In another thread, where no signal arrives,
a `Held` just makes and undoes the change.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType


class Held:
    """`with Held(apply, undo):` runs `apply()` as the block starts and `undo()` as it ends, neither split by
    Ctrl-C. `undo` runs iff `apply` returned; an `apply` that raises must leave nothing behind itself (no
    interrupt can, so only an error can stop it partway). A Ctrl-C during `apply` goes to the previous handler once
    the change is whole (a KeyboardInterrupt then undoes it, and the block never runs); one during `undo` once it
    is undone, unless the block already raised."""

    def __init__(self, apply: Callable[[], object], undo: Callable[[], object]):
        self.apply, self.undo = apply, undo
        self.holding = False  # record a SIGINT rather than pass it on
        self.received = False
        self.previous: Callable | int | None = None  # the SIGINT handler to pass it to and restore, None: not ours

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.holding or (frame is not None and frame.f_code is _EXIT):
            self.received = True
        else:
            _deliver(self.previous, signum, frame)

    def _hold(self) -> None:
        self.holding = True
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not None:
            self.previous = signal.signal(signal.SIGINT, self._handler)

    def _release(self, deliver: bool) -> None:
        """Put the previous handler back, then hand it a SIGINT that arrived meanwhile."""
        previous, received = self.previous, self.received
        self.previous, self.received = None, False
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
            if received and deliver:
                _deliver(previous, signal.SIGINT, None)

    def __enter__(self) -> Held:
        self._hold()
        try:
            self.apply()
        except BaseException:
            self._release(deliver=False)
            raise
        if self.received:  # a Ctrl-C while the change was made: the handler's turn now that it is whole
            self.received = False
            try:
                _deliver(self.previous, signal.SIGINT, None)
            except BaseException:  # KeyboardInterrupt: the change is undone and the block never runs
                try:
                    self.undo()
                finally:
                    self._release(deliver=False)
                raise
        self.holding = False  # no eval-breaker check from here to the block's first call
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.holding = True  # a SIGINT at this frame's first instruction is recorded by the frame check
        try:
            self.undo()
        finally:
            self._release(deliver=kind is None)


_EXIT = Held.__exit__.__code__


def _deliver(handler: Callable | int | None, signum: int, frame: FrameType | None) -> None:
    """What a SIGINT would have done under `handler`: the user's function, Python's KeyboardInterrupt, nothing for
    SIG_IGN, the process's default action for SIG_DFL."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)
