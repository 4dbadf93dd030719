"""The bridge process's limit on open file descriptors, raised at start to what its limits
can use: each upstream call in flight holds a connection (one socket), and the adaptive limit
of a server whose latency does not grow with load reaches `--max-in-flight` (16,384 by
default), beside up to `--max-connections` client connections. Most systems start a process
with a soft limit of 1,024 and a hard one far above; the soft limit may be raised to the hard
one without privileges, as servers commonly do at start.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def raise_limit(wanted: int) -> int:
    """Raise the soft RLIMIT_NOFILE to `wanted` descriptors (at most the hard limit); never
    lower it. Returns the soft limit now, with a warning when it stays under `wanted`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.debug("could not raise the open-files limit to %d: %s", target, exc)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning(
            "open-files limit %d is under the %d that --max-in-flight and --max-connections "
            "can use: a server whose latency does not grow with load may see refused "
            "connections; raise `ulimit -n` or lower --max-in-flight",
            soft,
            wanted,
        )
    return soft
