"""Where a trainer-side call goes and on what terms: a configured bridge target, or this process's
embedded bridge, with the TLS files, token, deadline and connect wait of `settings.py`.

Every adapter sends through a `Route`: the reward functions, the rollouts, the verl, slime and
OpenRLHF adapters and `score` resolve one (`Route.resolve`) and send each batch with `send` or
`asend` (a `stream.Call` to the route's address).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nemo_gym_grpc.rewards.client import embedded, settings, stream
from nemo_gym_grpc.rewards.client.channels import Security
from nemo_gym_grpc.rewards.client.outcomes import Failure


@dataclass(frozen=True)
class Route:
    """A call's bridge and terms.

    Attributes:
        target: the configured bridge's gRPC target, or None: the embedded bridge of `spec`,
            started on first use (`embedded.ensure_bridge`).
        spec: the embedded bridge's configuration, read when it is needed (so an unused
            `NEMO_GYM_HEAD_URL` is never read).
        security: TLS files and token; TLS applies to a configured target only (an embedded
            bridge listens in plaintext on loopback).
        timeout: gRPC deadline of one call, seconds.
        connect_timeout: most seconds one call waits for a connection (within `timeout`).
    """

    target: str | None
    spec: Callable[[], embedded.BridgeSpec]
    security: Security
    timeout: float
    connect_timeout: float

    @classmethod
    def resolve(
        cls,
        *,
        target: str | None,
        timeout: float,
        spec: Callable[[], embedded.BridgeSpec] = embedded.head_server_spec,
    ) -> Route:
        """The route of a call: `target` when given, else `NEMO_GYM_GRPC_TARGET`, else the
        embedded bridge of `spec` (default: one discovering servers from `NEMO_GYM_HEAD_URL`);
        security and connect wait from the environment (`settings.py`), read now.

        Raises:
            ValueError: an environment variable holds an invalid value (the message names it).
        """
        configured = target or settings.target()
        if configured is None:
            return cls.to_embedded(spec, timeout)
        return cls(configured, spec, settings.security(), timeout, settings.connect_timeout())

    @classmethod
    def to_embedded(cls, spec: Callable[[], embedded.BridgeSpec], timeout: float) -> Route:
        """The route to the embedded bridge of `spec`, whatever `NEMO_GYM_GRPC_TARGET` says
        (no TLS: it listens in plaintext on loopback; the token still applies).

        Raises:
            ValueError: an environment variable holds an invalid value.
        """
        return cls(None, spec, settings.security(tls=False), timeout, settings.connect_timeout())

    @property
    def label(self) -> str:
        """The bridge for messages: its target, or "embedded bridge"."""
        return self.target or "embedded bridge"

    def address(self) -> str:
        """The bridge's target, starting the embedded bridge if it has none.

        Raises:
            RuntimeError: the embedded bridge could not be started.
        """
        return self.target or embedded.ensure_bridge(self.spec())

    async def aaddress(self) -> str:
        """`address` for asyncio: an embedded bridge is started in a worker thread."""
        if self.target is not None:
            return self.target
        return await asyncio.to_thread(embedded.ensure_bridge, self.spec())

    def call(
        self,
        rpc: stream.Rpc[stream.Req, stream.Res, stream.Msg],
        address: str,
        requests: Sequence[stream.Req],
    ) -> stream.Call[stream.Req, stream.Res, stream.Msg]:
        """A `stream.Call` of `requests` to the bridge at `address`, on this route's terms."""
        return stream.Call(
            rpc,
            address,
            requests,
            timeout=self.timeout,
            connect_timeout=self.connect_timeout,
            security=self.security,
        )

    def send(
        self, rpc: stream.Rpc[stream.Req, stream.Res, stream.Msg], requests: Sequence[stream.Req]
    ) -> dict[str, stream.Res | Failure]:
        """{request_id: outcome} of `requests` sent over one `rpc` call to this route's bridge
        (`stream.Call`, `stream.send`); {} without a call (and without starting a bridge) when
        there is nothing to send.

        Raises:
            ValueError: two requests share a `request_id`.
            RuntimeError: the embedded bridge could not be started.
            ProtocolError: the bridge broke the stream's contract.
        """
        if not requests:
            return {}
        return stream.send(self.call(rpc, self.address(), requests))

    async def asend(
        self, rpc: stream.Rpc[stream.Req, stream.Res, stream.Msg], requests: Sequence[stream.Req]
    ) -> dict[str, stream.Res | Failure]:
        """`send` for asyncio (`stream.asend`; an embedded bridge starts in a worker thread)."""
        if not requests:
            return {}
        return await stream.asend(self.call(rpc, await self.aaddress(), requests))
