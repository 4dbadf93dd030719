"""A forked child starts with empty registries (channels, embedded bridges) and a fresh lock;
the parent keeps its own."""

from __future__ import annotations

import os
import threading

from nemo_gym_grpc.rewards.client.per_process import PerProcess


def test_a_forked_child_starts_empty_and_the_parent_keeps_its_entries():
    registry: PerProcess[str, object] = PerProcess()
    value = object()
    registry.entries["bridge"] = value
    held = threading.Event()
    release = threading.Event()

    def hold_the_lock() -> None:  # a thread that holds the lock while the fork happens
        with registry.lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    held.wait(10)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report what it sees, then leave without running pytest's teardown
        ok = registry.entries == {} and registry.lock.acquire(timeout=1)
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    release.set()
    holder.join()
    os.close(write)
    seen = os.read(read, 1)
    os.waitpid(pid, 0)
    assert seen == b"1"  # empty, and its lock free although the parent's was held
    assert registry.entries == {"bridge": value}
