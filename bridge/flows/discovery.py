"""Reading the NeMo Gym head server's config for a bridge process: one `HeadServer` shared by
its routing tables, so that one read serves them all, and reads rate-limited however many
callers name unknown servers or ask for a refresh.

The config is parsed in a worker thread (`asyncio.to_thread`), never on the event loop: a
large config takes a second or more to load, and calls in flight must not wait for it.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import aiohttp

from nemo_gym_grpc.bridge.nemo_gym import head

# Share of the time that reading the config may take: after a read that took `s` seconds the
# next waits at least `s / BUSY_SHARE` (a 0.5 s parse: 10 s), at most MAX_GAP seconds.
BUSY_SHARE = 0.05
MAX_GAP = 30.0


class HeadServer:
    """One head server's global config, read on demand at a bounded rate.

    Args:
        url: the head server's base URL (a trailing slash is dropped).
        session: the bridge's aiohttp session.
        timeout: seconds for one `/global_config_dict_yaml` GET.
        min_interval: seconds from the start of one read to the start of the next, at least.
        busy_share: see BUSY_SHARE (1.0 lets the next read start once the last has ended).

    Attributes:
        url: that URL.
        error: why the last read failed ("ExceptionType: message"), None after a success.
        config: the last config read (`head.load_config`), None before the first success.
        reads: how many reads were made (a routing table lists again when it changes).
    """

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        timeout: float = 5.0,
        min_interval: float = 1.0,
        busy_share: float = BUSY_SHARE,
    ) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._timeout = timeout
        self._min_interval = min_interval
        self._busy_share = busy_share
        self._lock = asyncio.Lock()
        self._started = -math.inf
        self._cost = 0.0
        self.error: str | None = None
        self.config: dict[Any, Any] | None = None
        self.reads = 0

    def due(self) -> bool:
        """True when a `read` now would ask the head server again."""
        gap = min(MAX_GAP, max(self._min_interval, self._cost / self._busy_share))
        return time.monotonic() - self._started >= gap

    async def read(self) -> dict[Any, Any]:
        """The config: read again when `due`, else the last one read (one read at a time;
        callers that come during a read share it).

        Raises:
            head.HeadUnreadable: the last read failed (`error` says why).
        """
        async with self._lock:
            if self.due():
                await self._read()
        if self.error is not None or self.config is None:
            raise head.HeadUnreadable(self.error or "not read yet")
        return self.config

    async def _read(self) -> None:
        self._started = time.monotonic()
        self.reads += 1
        try:
            body = await head.read_config(self._session, self.url, self._timeout)
            self.config = await asyncio.to_thread(head.load_config, body)
        except head.HeadUnreadable as exc:
            self.error = str(exc)
        else:
            self.error = None
        finally:
            self._cost = time.monotonic() - self._started
