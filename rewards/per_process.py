"""A registry that belongs to one process: a forked child starts with it empty.

Trainers fork (DataLoader workers, multiprocessing) after the reward functions have made gRPC
channels or started an embedded bridge. Those belong to the parent: a child that used them
would share the parent's gRPC state or stop the parent's bridge. So the child forgets them
(`os.register_at_fork`) but keeps them referenced, so that collecting them closes nothing.
"""

from __future__ import annotations

import os
import threading
from typing import Generic, TypeVar

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
