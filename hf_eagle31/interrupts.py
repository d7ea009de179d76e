"""Changes to a user's model that last for a call, each made and undone whole even when Ctrl-C arrives.

An EAGLE call switches the target's attention to EAGLE's (and, for "exact" verification of
bitsandbytes layers, wraps their forwards) and switches it back when the last call in flight ends.
A KeyboardInterrupt raised halfway through either step would leave the model half switched. Python
delivers SIGINT to the main thread as an exception at the next bytecode boundary; `HeldInterrupts`
records it instead while a step runs and raises it once the step is done.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


class HeldInterrupts:
    """A block during which a SIGINT (Ctrl-C, `_thread.interrupt_main`) is recorded, and raised as the block ends.
    Only the main thread receives signals; in another thread the block runs as it is."""

    def __init__(self):
        self.received = False
        self.previous = None

    def __enter__(self) -> HeldInterrupts:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._record)
        return self

    def _record(self, signum, frame) -> None:
        self.received = True

    def __exit__(self, kind, error, traceback) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        if self.received and kind is None:
            raise KeyboardInterrupt


@contextlib.contextmanager
def around(apply: Callable[[], object], undo: Callable[[], object]) -> Iterator[None]:
    """`apply()` as the block starts and `undo()` as it ends, neither split by Ctrl-C; `undo` runs whenever `apply`
    started, so it must also undo an `apply` that failed or was interrupted partway.

    Why a generator: an interrupt in the few bytecodes between the block's end and `undo` (or before the block's
    start) still closes the generator as the `with` statement unwinds, and closing it runs the `finally`."""
    started = False
    try:
        with HeldInterrupts():
            started = True
            apply()
        yield
    finally:
        if started:
            with HeldInterrupts():
                undo()
