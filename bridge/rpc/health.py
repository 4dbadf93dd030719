"""gRPC health checking (`grpc.health.v1`) for the bridge.

Statuses kept:
- `""` (the whole server) and `nemo_gym_grpc.v1.VerifyService`: NOT_SERVING until the routing
  table is known (a `--server` entry exists or one head-server discovery succeeded), SERVING
  after, NOT_SERVING again while draining.
- `nemo_gym_grpc.v1.VerifyService/<resources server name>`: the readiness view, SERVING while
  at least one of its upstream replicas answers NeMo Gym's liveness route `GET /` with 200,
  else NOT_SERVING.
- `nemo_gym_grpc.v1.RolloutService` and `nemo_gym_grpc.v1.RolloutService/<agent name>`: the
  same for the rollout service and each agent or environment server (a head server's
  discovery counts for both tables).
Kubernetes' gRPC probes and grpc-health-probe read these.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from grpc_health.v1 import health, health_pb2

from nemo_gym_grpc.bridge.flows.upstreams import Repeats, Upstreams
from nemo_gym_grpc.bridge.nemo_gym.head import HeadUnreadable
from nemo_gym_grpc.bridge.nemo_gym.http import answers
from nemo_gym_grpc.shared.contract import ROLLOUT_SERVICE, SESSION_SERVICE, VERIFY_SERVICE

log = logging.getLogger(__name__)

SERVICE_NAME = VERIFY_SERVICE.full_name
ROLLOUT_SERVICE_NAME = ROLLOUT_SERVICE.full_name
# Sessions run on the resources servers: SERVING with VerifyService.
SESSION_SERVICE_NAME = SESSION_SERVICE.full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def upstream_service_name(name: str, service: str = SERVICE_NAME) -> str:
    """The health service name of one resources server's (or, with `service`
    ROLLOUT_SERVICE_NAME, one agent's) readiness."""
    return f"{service}/{name}"


class Readiness:
    """Keeps the health statuses above up to date.

    Args:
        servicer: the server's `health.aio.HealthServicer`.
        upstreams: the routing table (discovery runs through it).
        session: aiohttp session for the liveness probes.
        interval: seconds between rounds (re-discovery while unknown, upstream probes;
            `--health-interval`).
        probe_timeout: seconds for one upstream `GET /`.
        agents: the AGENTS routing table, or None.
    """

    def __init__(
        self,
        servicer: health.aio.HealthServicer,
        upstreams: Upstreams,
        session: aiohttp.ClientSession,
        interval: float,
        probe_timeout: float = 2.0,
        agents: Upstreams | None = None,
    ) -> None:
        self._servicer = servicer
        self._upstreams = upstreams
        self._tables = [(upstreams, SERVICE_NAME)]
        if agents is not None:
            self._tables.append((agents, ROLLOUT_SERVICE_NAME))
        self._session = session
        self._interval = interval
        self._probe_timeout = probe_timeout
        self.known = False
        self._answering: dict[tuple[str, str], bool] = {}
        self._repeats = Repeats()

    async def run(self) -> None:
        """Run rounds forever (cancel to stop). The first round runs at once."""
        while True:
            await self.round()
            await asyncio.sleep(self._interval)

    async def round(self) -> None:
        """One round: discover while the table is unknown, then probe every upstream."""
        if not self.known:
            await self._learn_routes()
        for table, service in self._tables:
            entries = table.entries()
            answers = await asyncio.gather(*(self._any_answers(e.urls) for e in entries))
            for entry, ok in zip(entries, answers, strict=True):
                if self._answering.get((service, entry.name)) != ok:
                    state = "answers" if ok else "is DOWN"
                    log.info("%s %s %s", table.kind.noun, entry.name, state)
                    self._answering[(service, entry.name)] = ok
                await self._servicer.set(
                    upstream_service_name(entry.name, service), SERVING if ok else NOT_SERVING
                )

    async def _learn_routes(self) -> None:
        discovered = False
        unreadable: dict[str, str] = {}  # head URL -> why: one line for all its tables
        for table, _ in self._tables:
            if not table.head_url:
                continue
            try:
                found = await table.discover()
            except HeadUnreadable:
                unreadable[table.head_url] = table.discovery_error or ""
                continue
            log.info("discovered from %s: %s", table.head_url, found or f"no {table.kind.noun}s")
            discovered = True
        for url, why in unreadable.items():
            if self._repeats.due(url, why):
                log.warning(
                    "head server %s cannot be read (%s): no routes from it yet; asking again "
                    "every %g s",
                    url,
                    why,
                    self._interval,
                )
        self.known = discovered or any(table.names() for table, _ in self._tables)
        if self.known:
            self._log_routes()
            for service in ("", SESSION_SERVICE_NAME, *(service for _, service in self._tables)):
                await self._servicer.set(service, SERVING)

    def _log_routes(self) -> None:
        for table, _ in self._tables:
            for entry in table.entries():
                log.info(
                    "route %s -> %s (%s%s)",
                    entry.name,
                    ", ".join(entry.urls),
                    entry.source,
                    f", {entry.protocol}" if entry.protocol else "",
                )

    async def _any_answers(self, urls: list[str]) -> bool:
        """True when at least one replica answers its liveness route."""
        probes = (answers(self._session, url, self._probe_timeout) for url in urls)
        return any(await asyncio.gather(*probes))
