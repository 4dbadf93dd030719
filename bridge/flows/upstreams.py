"""The map from a server name to its upstream base URLs (one or more replicas): one table for
resources servers (`RESOURCES`), one for agent and environment servers (`AGENTS`).

Entries come only from configuration (`--server NAME=URL`, `--agent NAME=URL`,
`--environment-server NAME=URL`, repeated with the same NAME for replicas) and from the NeMo
Gym head server's `GET /global_config_dict_yaml` (one URL per instance name, read by
`nemo_gym.head.global_servers`); the bridge never calls a URL taken from a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.nemo_gym import head
from nemo_gym_grpc.shared import reasons

log = logging.getLogger(__name__)

STATIC = "static"
HEAD_SERVER = "head_server"
# Seconds before a warning whose cause has not changed is logged again.
REPEAT_WARNING_AFTER = 60.0


class Repeats:
    """Which repeats of a warning to log: the first, one whose text changed, and one every
    REPEAT_WARNING_AFTER seconds while the same cause lasts (a head server that stays down is
    not logged on every try)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[str, float]] = {}  # key -> (text, when logged)

    def due(self, key: str, text: str) -> bool:
        """True when the warning `text` about `key` (e.g. a URL) is to be logged now."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and last[0] == text and now - last[1] < REPEAT_WARNING_AFTER:
            return False
        self._last[key] = (text, now)
        return True


@dataclass(frozen=True)
class Kind:
    """What one routing table holds.

    Attributes:
        noun: the servers' name in messages, e.g. "resources server".
        blocks: {head-server config block: protocol} discovered (`nemo_gym.head.parse_servers`).
        unknown_reason: the ErrorInfo reason of an unknown name (NOT_FOUND).
        field: the ErrorInfo metadata key that names the server.
        log_field: the log record field that names it.
    """

    noun: str
    blocks: Mapping[str, str]
    unknown_reason: str
    field: str
    log_field: str


RESOURCES = Kind(
    "resources server",
    head.RESOURCES_SERVERS,
    reasons.UNKNOWN_RESOURCES_SERVER,
    "resourcesServer",
    "resources_server",
)
AGENTS = Kind("agent", head.AGENT_SERVERS, reasons.UNKNOWN_AGENT, "agent", "agent")


@dataclass
class Upstream:
    """A routable server: its name, base URLs (no trailing slash), origin and protocol
    ("" for resources servers; `head.AGENT` or `head.ENVIRONMENT` in the AGENTS table)."""

    name: str
    urls: list[str] = field(default_factory=list)
    source: str = STATIC
    protocol: str = ""


def _url_list(urls: str | Sequence[str]) -> list[str]:
    """One base URL or several, as a list without trailing slashes or repeats (order kept)."""
    listed = [urls] if isinstance(urls, str) else list(urls)
    return list(dict.fromkeys(url.rstrip("/") for url in listed))


class Upstreams:
    """Name -> upstream base URLs routing table with head-server discovery.

    Args:
        static: {name: base URL or [base URL, ...]} from `--server` (several URLs = replicas
            of one server); these win over discovered entries.
        head_url: NeMo Gym head server base URL, or None for static routing only.
        session: the bridge's aiohttp session.
        discovery_timeout: seconds for one `/global_config_dict_yaml` request.
        min_rediscover_interval: seconds between re-discoveries triggered by unknown names.
        kind: what the table holds (RESOURCES or AGENTS).
        static_protocols: {name: protocol} of static entries (default: the first protocol
            of `kind.blocks`).
    """

    def __init__(
        self,
        static: Mapping[str, str | Sequence[str]],
        head_url: str | None,
        session: aiohttp.ClientSession,
        discovery_timeout: float = 5.0,
        min_rediscover_interval: float = 1.0,
        *,
        kind: Kind = RESOURCES,
        static_protocols: Mapping[str, str] | None = None,
    ) -> None:
        self.kind = kind
        self._static = {name: _url_list(urls) for name, urls in static.items() if urls}
        default_protocol = next(iter(kind.blocks.values()), "")
        self._static_protocols = {
            name: (static_protocols or {}).get(name, default_protocol) for name in self._static
        }
        self._discovered: dict[str, tuple[str, str]] = {}
        self.head_url = head_url.rstrip("/") if head_url else None
        self._session = session
        self._timeout = discovery_timeout
        self._interval = min_rediscover_interval
        self._last_discovery = -float("inf")
        self._lock = asyncio.Lock()
        # Why the last discovery failed ("ExceptionType: message"), None after a success.
        self.discovery_error: str | None = None
        # Whether a discovery has succeeded.
        self.discovered = False
        self._repeats = Repeats()

    async def discover(self) -> dict[str, str]:
        """Fetch the head server's config and replace the discovered entries.

        Returns the discovered {name: base URL}. Raises aiohttp.ClientError, TimeoutError or
        ValueError when the head server cannot be read (kept in `discovery_error`).
        """
        if not self.head_url:
            return {}
        self._last_discovery = time.monotonic()
        try:
            self._discovered = await head.global_servers(
                self._session, self.head_url, self._timeout, self.kind.blocks
            )
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.discovery_error = f"{type(exc).__name__}: {exc}"
            raise
        self.discovery_error = None
        self.discovered = True
        return {name: url for name, (url, _) in self._discovered.items()}

    def get(self, name: str) -> list[str] | None:
        """The base URLs (replicas) for `name`, or None when unknown (no discovery)."""
        if name in self._static:
            return self._static[name]
        route = self._discovered.get(name)
        return [route[0]] if route else None

    def protocol(self, name: str) -> str:
        """The protocol of routable `name` (see `Upstream.protocol`); "" when unknown."""
        if name in self._static:
            return self._static_protocols[name]
        route = self._discovered.get(name)
        return route[1] if route else ""

    async def resolve(self, name: str) -> list[str]:
        """The base URLs (one or more replicas) for `name`, re-discovering once when it is
        unknown (at most once per `min_rediscover_interval`; logged at INFO).

        Raises:
            errors.ItemError: UNAVAILABLE / HEAD_SERVER_UNAVAILABLE when `name` is unknown
                and the head server could not be read the last time it was asked (the name
                may be there; `discoveryError` says why); NOT_FOUND / `kind.unknown_reason`
                (UNKNOWN_RESOURCES_SERVER, UNKNOWN_AGENT) when the head server answered
                without it, or there is no head server. Both name the known servers.
        """
        noun, key = self.kind.noun, self.kind.field
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
                        "%s %r is unknown: discovering from the head server %s",
                        noun,
                        name[:100],
                        self.head_url,
                        extra={"event": "rediscovery", self.kind.log_field: name[:100]},
                    )
                    try:
                        found = await self.discover()
                    except (aiohttp.ClientError, TimeoutError, ValueError):
                        why = self.discovery_error or ""
                        if self._repeats.due(self.head_url, why):
                            log.warning("re-discovery from %s failed: %s", self.head_url, why)
                    else:
                        log.info("re-discovery found %d %ss", len(found), noun)
                urls = self.get(name)
                if urls:
                    return urls
        known = ", ".join(sorted(self.names())) or "none"
        failed = self.discovery_error if self.head_url else None
        if failed:
            error = errors.ItemError(
                code_pb2.UNAVAILABLE,
                reasons.HEAD_SERVER_UNAVAILABLE,
                f"{noun} {name[:100]!r} is not known and the head server "
                f"{self.head_url} could not be read: {failed}; known: {known}",
                discoveryError=failed,
                headUrl=self.head_url,
            )
        else:
            error = errors.ItemError(
                code_pb2.NOT_FOUND,
                self.kind.unknown_reason,
                f"unknown {noun} {name[:100]!r}; known: {known}",
            )
        error.metadata[key] = errors.utf8_text(name[:100])
        raise error

    def names(self) -> set[str]:
        """Every routable name."""
        return set(self._static) | set(self._discovered)

    def entries(self) -> list[Upstream]:
        """Every routable server, sorted by name."""
        return [
            Upstream(
                name,
                self.get(name) or [],
                STATIC if name in self._static else HEAD_SERVER,
                self.protocol(name),
            )
            for name in sorted(self.names())
        ]
