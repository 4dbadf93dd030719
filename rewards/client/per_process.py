"""What belongs to one trainer process: registries a forked child starts empty, and gRPC's
fork support.

Trainers fork (DataLoader workers, multiprocessing) after the reward functions have made gRPC
channels or started an embedded bridge. Those belong to the parent: a child that used them
would share the parent's gRPC state or stop the parent's bridge. So the child forgets them
(`os.register_at_fork`) but keeps them referenced, so that collecting them closes nothing.

Without gRPC's fork support a forked child that scores crashes now and then inside gRPC core
("Check failed: next_worker->state == KICKED"). grpcio reads `GRPC_ENABLE_FORK_SUPPORT` when
`grpc` is imported, so `nemo_gym_grpc.rewards.client` imports this module before any of its
modules imports grpc, and this module sets it to "1" unless the user set it
(`FORK_SUPPORT_DEFAULTED`). Only the client machinery sets it: `nemo-gym-grpc serve` and the
embedded bridge (a grpc.aio server, which forks only before gRPC starts) never get it from
here (`child_env`).

That fork support needs no application thread inside gRPC at the fork (grpcio's own rule). A
child forked while another thread reads a call can hang in gRPC's fork handler: axolotl's
DataLoader worker, forked while its prefetch thread read a RunStream, stuck for good in grpc's
`Channel._postfork_child` (2026-12). So the sync calls count themselves while read
(`in_flight`), and a fork made meanwhile gets one WARNING naming the cause.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
FORK_SUPPORT_DEFAULTED = FORK_SUPPORT_ENV not in os.environ
os.environ.setdefault(FORK_SUPPORT_ENV, "1")

log = logging.getLogger("nemo_gym_grpc.rewards")

K = TypeVar("K")
V = TypeVar("V")


class PerProcess(Generic[K, V]):
    """A dict (`entries`) and the lock that guards it (`lock`), both made anew in a forked
    child, where `entries` starts empty."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[K, V] = {}
        self._inherited: list[V] = []
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self.lock = threading.Lock()  # another thread may have held it at the fork
        self._inherited.extend(self.entries.values())
        self.entries.clear()


def child_env() -> dict[str, str]:
    """This process's environment for a child that is no trainer (the embedded bridge): without
    the fork support this module turned on, unless the user set it."""
    env = dict(os.environ)
    if FORK_SUPPORT_DEFAULTED:
        env.pop(FORK_SUPPORT_ENV, None)
    return env


class _InFlight:
    """The number of sync calls being read now, and the WARNING of a fork made meanwhile."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.warned = False
        os.register_at_fork(before=self._before_fork, after_in_child=self._reset)

    def _before_fork(self) -> None:
        if self.count and not self.warned:
            self.warned = True
            log.warning(
                "this process forks while %d NeMo Gym gRPC call(s) are read by other threads: "
                "the child may hang in gRPC's fork handler (gRPC needs no thread inside it at "
                "a fork). Fork before scoring or between calls, e.g. dataloader_num_workers=0 "
                "in a trainer that scores in a background thread",
                self.count,
            )

    def _reset(self) -> None:
        self.lock, self.count, self.warned = threading.Lock(), 0, False


_IN_FLIGHT = _InFlight()


@contextlib.contextmanager
def in_flight() -> Iterator[None]:
    """Around reading a sync gRPC call: counted for the fork WARNING (module docstring)."""
    with _IN_FLIGHT.lock:
        _IN_FLIGHT.count += 1
    try:
        yield
    finally:
        with _IN_FLIGHT.lock:
            _IN_FLIGHT.count -= 1
