"""The map from resources server name to its upstream base URLs (one or more replicas).

Entries come only from configuration (`--server NAME=URL`, repeated with the same NAME for
replicas) and from the NeMo Gym head server's `GET /global_config_dict_yaml` (one URL per
instance name, read by `nemo_gym.global_config`); the bridge never calls a URL taken from a
request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors, nemo_gym

log = logging.getLogger(__name__)

STATIC = "static"
HEAD_SERVER = "head_server"


@dataclass
class Upstream:
    """A routable resources server: its name, base URLs (no trailing slash) and origin."""

    name: str
    urls: list[str] = field(default_factory=list)
    source: str = STATIC


def _url_list(urls: str | Sequence[str]) -> list[str]:
    """One base URL or several, as a list without trailing slashes or repeats (order kept)."""
    listed = [urls] if isinstance(urls, str) else list(urls)
    return list(dict.fromkeys(url.rstrip("/") for url in listed))


class Upstreams:
    """Name -> upstream base URLs routing table with head-server discovery.

    Args:
        static: {name: base URL or [base URL, ...]} from `--server` (several URLs = replicas
            of one resources server); these win over discovered entries.
        head_url: NeMo Gym head server base URL, or None for static routing only.
        session: the bridge's aiohttp session.
        discovery_timeout: seconds for one `/global_config_dict_yaml` request.
        min_rediscover_interval: seconds between re-discoveries triggered by unknown names.
    """

    def __init__(
        self,
        static: Mapping[str, str | Sequence[str]],
        head_url: str | None,
        session: aiohttp.ClientSession,
        discovery_timeout: float = 5.0,
        min_rediscover_interval: float = 1.0,
    ) -> None:
        self._static = {name: _url_list(urls) for name, urls in static.items() if urls}
        self._discovered: dict[str, str] = {}
        self.head_url = head_url.rstrip("/") if head_url else None
        self._session = session
        self._timeout = discovery_timeout
        self._interval = min_rediscover_interval
        self._last_discovery = -float("inf")
        self._lock = asyncio.Lock()
        # Why the last discovery failed ("ExceptionType: message"), None after a success.
        self.discovery_error: str | None = None

    async def discover(self) -> dict[str, str]:
        """Fetch the head server's config and replace the discovered entries.

        Returns the discovered {name: base URL}. Raises aiohttp.ClientError, TimeoutError or
        ValueError when the head server cannot be read (kept in `discovery_error`).
        """
        if not self.head_url:
            return {}
        self._last_discovery = time.monotonic()
        try:
            self._discovered = await nemo_gym.global_config(
                self._session, self.head_url, self._timeout
            )
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.discovery_error = f"{type(exc).__name__}: {exc}"
            raise
        self.discovery_error = None
        return self._discovered

    def get(self, name: str) -> list[str] | None:
        """The base URLs (replicas) for `name`, or None when unknown (no discovery)."""
        if name in self._static:
            return self._static[name]
        url = self._discovered.get(name)
        return [url] if url else None

    async def resolve(self, name: str) -> list[str]:
        """The base URLs (one or more replicas) for `name`, re-discovering once when it is
        unknown (at most once per `min_rediscover_interval`; logged at INFO).

        Raises:
            errors.ItemError: UNAVAILABLE / HEAD_SERVER_UNAVAILABLE when `name` is unknown
                and the head server could not be read the last time it was asked (the name
                may be there; `discoveryError` says why); NOT_FOUND /
                UNKNOWN_RESOURCES_SERVER when the head server answered without it, or there
                is no head server. Both name the known servers.
        """
        urls = self.get(name)
        if urls:
            return urls
        if self.head_url:
            async with self._lock:
                urls = self.get(name)
                if urls:
                    return urls
                if time.monotonic() - self._last_discovery >= self._interval:
                    log.info(
                        "resources server %r is unknown: discovering from the head server %s",
                        name[:100],
                        self.head_url,
                        extra={"event": "rediscovery", "resources_server": name[:100]},
                    )
                    try:
                        found = await self.discover()
                    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                        log.warning("re-discovery from %s failed: %r", self.head_url, exc)
                    else:
                        log.info("re-discovery found %d resources servers", len(found))
                urls = self.get(name)
                if urls:
                    return urls
        known = ", ".join(sorted(self.names())) or "none"
        failed = self.discovery_error if self.head_url else None
        if failed:
            raise errors.ItemError(
                code_pb2.UNAVAILABLE,
                errors.HEAD_SERVER_UNAVAILABLE,
                f"resources server {name[:100]!r} is not known and the head server "
                f"{self.head_url} could not be read: {failed}; known: {known}",
                resourcesServer=name[:100],
                discoveryError=failed,
                headUrl=self.head_url,
            )
        raise errors.ItemError(
            code_pb2.NOT_FOUND,
            errors.UNKNOWN_RESOURCES_SERVER,
            f"unknown resources server {name[:100]!r}; known: {known}",
            resourcesServer=name[:100],
        )

    def names(self) -> set[str]:
        """Every routable name."""
        return set(self._static) | set(self._discovered)

    def entries(self) -> list[Upstream]:
        """Every routable server, sorted by name."""
        return [
            Upstream(name, self.get(name) or [], STATIC if name in self._static else HEAD_SERVER)
            for name in sorted(self.names())
        ]
