"""Ending a sync call from another thread: `Stopper`, the scope a caller's sends run in.

grpcio's sync streaming call (`stream.send`) blocks the thread that reads it until the call
ends. A trainer that finishes while a batch is still in flight (axolotl's prefetch thread
running the next step's rollouts after the last step) must end that call from its own thread,
or the process waits at exit for rollouts nobody will train on. So a caller runs its sends
inside `Stopper.running()`; `send` registers each stream it opens (`watch`), and
`Stopper.stop()`, from any thread, cancels them: the bridge cancels the items' `/run` or
`/verify` requests, every item without a result gets the call's CANCELLED `Failure`
(one outcome per item, as for any failed call), and a stream opened after the stop is
cancelled as it opens.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Protocol


class Cancellable(Protocol):
    """A sync or asyncio gRPC call (both can be cancelled)."""

    def cancel(self) -> bool: ...


_CURRENT: contextvars.ContextVar[Stopper | None] = contextvars.ContextVar(
    "nemo_gym_grpc_stopper", default=None
)


class Stopper:
    """Cancels the calls made inside `running()` (in this thread) when `stop()` is called
    (from any thread). One-shot: once stopped, it stays stopped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: set[Cancellable] = set()
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether `stop()` has been called."""
        return self._stopped

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Make this the stopper of the sends made in the block (in the current thread)."""
        token = _CURRENT.set(self)
        try:
            yield
        finally:
            _CURRENT.reset(token)

    def stop(self) -> None:
        """Cancel every call open in a `running()` block, and each one opened later."""
        with self._lock:
            self._stopped = True
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def _add(self, call: Cancellable) -> bool:
        """Register `call`; False (not registered) when already stopped."""
        with self._lock:
            if not self._stopped:
                self._calls.add(call)
            return not self._stopped

    def _discard(self, call: Cancellable) -> None:
        with self._lock:
            self._calls.discard(call)


@contextlib.contextmanager
def watch(call: Cancellable) -> Iterator[None]:
    """Around reading `call`: the current `Stopper` (if any) can cancel it; cancelled at once
    when that stopper has already stopped."""
    stopper = _CURRENT.get()
    if stopper is None:
        yield
        return
    if not stopper._add(call):
        call.cancel()
    try:
        yield
    finally:
        stopper._discard(call)
