"""Which addresses the bridge dials (`--deny-upstream`, `--allow-upstream`): every upstream
address is checked before a connection is made, whether it is written in a URL or a name
resolves to it.

Where the check runs: `plain_http` resolves a name itself and connects only to the allowed
addresses; the aiohttp session (https upstreams, probes, discovery) checks an address written
in the URL before the request starts (`trace_config`) and a name's addresses as they resolve
(`FilteringResolver`). A refused upstream fails its items FAILED_PRECONDITION /
UPSTREAM_ADDRESS_REFUSED (`http.post`) and is never SERVING.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# Never dialed unless a policy says otherwise: link-local ranges (cloud metadata services
# answer at 169.254.169.254; no NeMo Gym server lives there).
DEFAULT_DENY: tuple[Network, ...] = (
    ipaddress.ip_network("169.254.0.0/16"),
    ipaddress.ip_network("fe80::/10"),
)


class Denied(aiohttp.ClientOSError):
    """The policy refuses every address of a host: nothing was sent. The message says
    which address and rule."""


@dataclass(frozen=True)
class Policy:
    """Address ranges to refuse, and (when `allow` is not empty) the only ones to dial.

    Attributes:
        deny: refused ranges (DEFAULT_DENY plus `--deny-upstream`).
        allow: `--allow-upstream` ranges; empty: every address not denied.
    """

    deny: tuple[Network, ...] = DEFAULT_DENY
    allow: tuple[Network, ...] = ()

    def refuses(self, address: str) -> str:
        """Why IP `address` is not dialed, "" when it may be. An IPv4-mapped IPv6 address is
        judged as its IPv4 address."""
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        for network in self.deny:
            if ip.version == network.version and ip in network:
                return f"{address} is in the denied range {network}"
        if self.allow and not any(ip.version == n.version and ip in n for n in self.allow):
            allowed = ", ".join(str(network) for network in self.allow)
            return f"{address} is in none of the allowed ranges ({allowed})"
        return ""

    @functools.lru_cache(maxsize=256)  # noqa: B019 - a policy lives as long as the process
    def literal_refused(self, host: str) -> str:
        """`refuses(host)` when `host` is an IP address, "" for a name (checked as it
        resolves)."""
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return ""
        return self.refuses(host)

    async def addresses(self, host: str, port: int) -> list[str]:
        """The addresses of `host` to try, in the resolver's order: itself when it is an IP
        address, else what it resolves to (TCP); only those the policy allows.

        Raises:
            Denied: it has addresses, none allowed. OSError: it does not resolve.
        """
        why = self.literal_refused(host)
        if why:
            raise Denied(why)
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
            return [host]
        except ValueError:
            pass
        loop = asyncio.get_running_loop()
        found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return self.allowed(host, [str(info[4][0]) for info in found])

    def allowed(self, host: str, addresses: Sequence[str]) -> list[str]:
        """`addresses` of `host` the policy allows (repeats dropped, order kept).

        Raises:
            Denied: there were some, none is allowed.
        """
        kept = [address for address in dict.fromkeys(addresses) if not self.refuses(address)]
        if addresses and not kept:
            raise Denied(f"{host}: {self.refuses(addresses[0])}")
        return kept


class FilteringResolver(AbstractResolver):
    """aiohttp's threaded resolver, keeping only the addresses `policy` allows (Denied when
    none is left)."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        allowed = set(self._policy.allowed(host, [str(r["host"]) for r in found]))
        return [r for r in found if str(r["host"]) in allowed]

    async def close(self) -> None:
        await self._inner.close()


def trace_config(policy: Policy) -> aiohttp.TraceConfig:
    """An aiohttp TraceConfig that raises Denied before a request to a URL whose host is a
    refused IP address (aiohttp does not resolve those, so the resolver never sees them)."""

    async def check(_session: Any, _context: Any, params: aiohttp.TraceRequestStartParams) -> None:
        why = policy.literal_refused(params.url.host or "")
        if why:
            raise Denied(why)

    traces = aiohttp.TraceConfig()
    traces.on_request_start.append(check)
    return traces
