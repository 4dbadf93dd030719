"""The bridge process's memory management: the C allocator, set so that memory freed after a
burst of large items or replies goes back to the system (`return_large_frees`), and Python's
cycle collector, set to run less often (`collect_less`).

glibc's malloc serves a request of at least M_MMAP_THRESHOLD bytes from a mapping of its own,
unmapped when freed, but by default it raises that threshold up to 32 MiB each time such a block
is freed, after which blocks of a few MiB (a long row, a reply, a rollout's output) come from
the heap and stay with the process when freed. Measured with benchmarks/memory.py on the
bridge's defaults: 75 items with 4 MiB request_ids left 539 MB held while idle, 84 MB with the
threshold fixed at 128 KiB (peak 830 -> 545 MB). Fixing it (`mallopt`, as the
MALLOC_MMAP_THRESHOLD_ variable does) turns off that adjustment; smaller blocks are unaffected.

The cycle collector ran a young-generation pass every 700 net allocations of container objects,
a few per item (its task, coroutines, futures, dicts of the body), and found nearly nothing:
the bridge's objects are freed by their reference counts (measured at capacity, zero-work
upstream, 26,000 items: 811 young, 74 middle and 6 full passes, 0.34 s, about 14% of the
bridge's CPU, 2,202 objects collected in all). So the young generation is collected every
YOUNG_THRESHOLD allocations, and what exists once the bridge has started (its modules, gRPC's
and protobuf's) is frozen out of every pass (`gc.freeze`). Side by side at capacity
(docs/performance.md): 11-15% less bridge CPU per item. A cycle that is garbage now waits
longer, with all it holds (frames, bodies): so the bridge leaves none behind per item or per
connection (bridge/errors.py; while it did, the soak's RSS rose 15%).
"""

from __future__ import annotations

import ctypes
import gc
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 128 * 1024
# Net allocations of container objects between two young-generation passes (Python's: 700).
YOUNG_THRESHOLD = 50_000


def return_large_frees() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES (see the module docstring). True when
    set; False where the C library has no `mallopt` or refuses (e.g. not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    log.debug("malloc mmap threshold %d bytes: %s", MMAP_THRESHOLD_BYTES, done)
    return done


def collect_less() -> None:
    """Collect the young generation every YOUNG_THRESHOLD allocations (the older generations'
    thresholds kept) and freeze what exists now out of every pass (see the module docstring).
    Call once the bridge's modules are imported."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    gc.freeze()
