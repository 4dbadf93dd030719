"""The bridge process's C allocator, set so that memory freed after a burst of large items or
replies goes back to the system.

glibc's malloc serves a request of at least M_MMAP_THRESHOLD bytes from a mapping of its own,
unmapped when freed, but by default it raises that threshold up to 32 MiB each time such a block
is freed, after which blocks of a few MiB (a long row, a reply, a rollout's output) come from
the heap and stay with the process when freed. Measured with benchmarks/memory.py on the
bridge's defaults: 75 items with 4 MiB request_ids left 539 MB held while idle, 84 MB with the
threshold fixed at 128 KiB (peak 830 -> 545 MB). Fixing it (`mallopt`, as the
MALLOC_MMAP_THRESHOLD_ variable does) turns off that adjustment; smaller blocks are unaffected.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 128 * 1024


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
