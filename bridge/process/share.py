"""`serve --sharing-bridges-file`: the number of bridges that share the NeMo Gym servers,
followed while the bridge runs.

Each bridge's adaptive limits keep 1/N of a server's standing queue when N bridges call it
(`flows.limits`, `--sharing-bridges`). A Ray fleet that grows starts its new bridges with the
new N, but those already running keep the N they started with, so each would keep a larger
share than its own and the server a longer queue than the limits aim for. The fleet's actors
write the number into a file per bridge as the fleet's registry changes (`ray.actors`), and the
bridge reads that file again whenever it changes (its modification time or size), checked
every POLL_SECONDS.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from nemo_gym_grpc.bridge.flows.balancer import Balancer

log = logging.getLogger(__name__)

POLL_SECONDS = 2.0


def read_share(path: Path) -> int | None:
    """The positive whole number `path` holds (surrounding whitespace ignored); None, with a
    warning logged, when it cannot be read or holds anything else. A missing file is None
    without a warning (the fleet has not written it yet)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("cannot read --sharing-bridges-file %s: %s", path, exc)
        return None
    if text.strip().isdigit() and int(text) > 0:
        return int(text)
    log.warning("--sharing-bridges-file %s holds %r, not a positive number", path, text[:40])
    return None


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


async def follow(
    path: Path, balancer: Balancer, factor: int = 1, every: float = POLL_SECONDS
) -> None:
    """Until cancelled: read `path` now and whenever it changed, checked every `every`
    seconds, and set the limiters that share each upstream's queue to its number times
    `factor` (this process's share of a bridge: `serve --workers`), logging each change. A
    missing file or a bad value keeps the number the limiters have."""
    seen: tuple[int, int] | None = None
    while True:
        stamp = _stamp(path)
        if stamp is not None and stamp != seen:
            seen = stamp
            found = read_share(path)
            if found is not None and found * factor != balancer.share:
                log.info(
                    "sharing bridges: %s -> %d limiters per upstream queue",
                    balancer.share,
                    found * factor,
                )
                balancer.reshare(found * factor)
        await asyncio.sleep(every)
