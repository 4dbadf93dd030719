"""The map from a server name to its upstream base URLs (one or more replicas): one table for
resources servers (`RESOURCES`), one for agent and environment servers (`AGENTS`).

Entries come only from configuration (`--server NAME=URL`, `--agent NAME=URL`,
`--environment-server NAME=URL`, repeated with the same NAME for replicas) and from the NeMo
Gym head server's `GET /global_config_dict_yaml` (one URL per instance name, read by
`discovery.HeadServer`); the bridge never calls a URL taken from a request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows.discovery import HeadServer
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
        blocks: {head-server config block: protocol} discovered (`nemo_gym.head.list_servers`).
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
        head_server: the bridge's NeMo Gym head server (shared by its tables), or None for
            static routing only.
        kind: what the table holds (RESOURCES or AGENTS).
        static_protocols: {name: protocol} of static entries (default: the first protocol
            of `kind.blocks`).
    """

    def __init__(
        self,
        static: Mapping[str, str | Sequence[str]],
        head_server: HeadServer | None = None,
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
        self._refused: dict[str, str] = {}  # name -> why its head-server entry is refused
        self._listed_from: dict[Any, Any] | None = None
        self.head_server = head_server
        self.head_url = head_server.url if head_server else None
        self._repeats = Repeats()

    @property
    def discovery_error(self) -> str | None:
        """Why the last read of the head server failed ("ExceptionType: message"), None
        after a success or without a head server."""
        return self.head_server.error if self.head_server else None

    @property
    def discovered(self) -> bool:
        """Whether the routes of a head-server read are in the table."""
        return self._listed_from is not None

    async def discover(self) -> dict[str, str]:
        """Read the head server's config (`HeadServer.read`: at a bounded rate) and replace the
        discovered entries; entries whose address is refused are logged (once per cause).

        Returns the discovered {name: base URL}. Raises head.HeadUnreadable when the head
        server cannot be read (`discovery_error` says why); the last routes stay.
        """
        if self.head_server is None:
            return {}
        config = await self.head_server.read()
        if config is not self._listed_from:
            listing = head.list_servers(config, self.head_server.url, self.kind.blocks)
            self._discovered, self._refused = listing.found, listing.refused
            self._listed_from = config
            for name, why in self._refused.items():
                if self._repeats.due(f"refused {name}", why):
                    log.warning(
                        "%s %r in the head server's config is refused: %s",
                        self.kind.noun,
                        name[:100],
                        why,
                        extra={"event": "route_refused", self.kind.log_field: name[:100]},
                    )
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
        """The base URLs (one or more replicas) for `name`, reading the head server again when
        it is unknown (at the rate `HeadServer` allows; logged at INFO).

        Raises:
            errors.ItemError: UNAVAILABLE / HEAD_SERVER_UNAVAILABLE when `name` is unknown
                and the head server could not be read the last time it was asked (the name
                may be there; `discoveryError` says why); FAILED_PRECONDITION /
                UPSTREAM_ADDRESS_REFUSED when its head-server entry's address is refused
                (`why` says how); NOT_FOUND / `kind.unknown_reason` (UNKNOWN_RESOURCES_SERVER,
                UNKNOWN_AGENT) when the head server answered without it, or there is no head
                server. The first and last name the known servers.
        """
        urls = self.get(name)
        if urls:
            return urls
        if self.head_server is not None:
            await self._rediscover(name)
            urls = self.get(name)
            if urls:
                return urls
        raise self._unknown(name)

    async def moved(self, name: str, urls: list[str]) -> list[str]:
        """The URLs of `name` after one of `urls` refused a connection: when `name` came from
        the head server, it is read again (at the rate `HeadServer` allows), so a server that
        restarted elsewhere takes items once the head server lists it there. Returns its URLs
        now; `urls` when it is static, no longer listed, or the read failed or was not due.
        """
        if name in self._static or self.head_server is None or not self.head_server.due():
            return urls
        try:
            await self.discover()
        except head.HeadUnreadable:
            return urls
        now = self.get(name) or urls
        if now != urls:
            log.info(
                "%s %r moved: %s -> %s", self.kind.noun, name[:100], ", ".join(urls), ", ".join(now)
            )
        return now

    async def _rediscover(self, name: str) -> None:
        """Read the head server again for unknown `name`; a failure is logged (once per
        cause), not raised."""
        assert self.head_server is not None
        fresh = self.head_server.due()
        if fresh:
            log.info(
                "%s %r is unknown: discovering from the head server %s",
                self.kind.noun,
                name[:100],
                self.head_url,
                extra={"event": "rediscovery", self.kind.log_field: name[:100]},
            )
        try:
            found = await self.discover()
        except head.HeadUnreadable as exc:
            if self._repeats.due(self.head_server.url, str(exc)):
                log.warning("re-discovery from %s failed: %s", self.head_url, exc)
        else:
            if fresh:
                log.info("re-discovery found %d %ss", len(found), self.kind.noun)

    def _unknown(self, name: str) -> errors.ItemError:
        """The failure of an item for `name`, which has no route (see `resolve`)."""
        noun = self.kind.noun
        known = ", ".join(sorted(self.names())) or "none"
        failed = self.discovery_error
        if failed:
            error = errors.ItemError(
                code_pb2.UNAVAILABLE,
                reasons.HEAD_SERVER_UNAVAILABLE,
                f"{noun} {name[:100]!r} is not known and the head server "
                f"{self.head_url} could not be read: {failed}; known: {known}",
                discoveryError=failed,
                headUrl=self.head_url or "",
            )
        elif name in self._refused:
            error = errors.ItemError(
                code_pb2.FAILED_PRECONDITION,
                reasons.UPSTREAM_ADDRESS_REFUSED,
                f"{noun} {name[:100]!r} is listed by the head server {self.head_url} with an "
                f"address the bridge refuses: {self._refused[name]}",
                why=self._refused[name],
                headUrl=self.head_url or "",
            )
        else:
            error = errors.ItemError(
                code_pb2.NOT_FOUND,
                self.kind.unknown_reason,
                f"unknown {noun} {name[:100]!r}; known: {known}",
            )
        error.metadata[self.kind.field] = errors.utf8_text(name[:100])
        return error

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
