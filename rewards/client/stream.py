"""The trainer side's one call path: where a call goes (`Route`: a configured bridge target or
this process's embedded bridge, with the TLS files, token, deadline and connect wait of
`settings.py`), and the one streaming call that carries a batch of items there (`Call`, over
`VerifyStream` or `RunStream`), one outcome per item, keyed by `request_id`.

Every adapter sends through a `Route`: the reward functions, the rollouts, the verl, slime and
OpenRLHF adapters and `score` resolve one (`Route.resolve`) and send each batch with `send` or
`asend`; the AsyncGRPOTrainer worker's long-lived feed (`live.py`) opens its calls on one too.
`Call` (the books of one call) is the same for both RPCs (`VERIFY`, `RUN`), both faces and the
feed. `send` drives it over grpcio on the process's shared channel (`channels.shared`); `asend`
over grpc.aio on a channel of its own per stream, closed before it returns, so it can be awaited
from any event loop in any thread, one call after another or at once (a loopback handshake, ~1
ms, per call). Both resend what a broken stream left unanswered on a new stream (`resend.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Literal, Protocol, TypeVar

import grpc
from google.rpc import status_pb2

from nemo_gym_grpc.rewards.client import channels, embedded, resend, settings, stopping
from nemo_gym_grpc.rewards.client.channels import Security
from nemo_gym_grpc.rewards.client.outcomes import Failure, ProtocolError
from nemo_gym_grpc.rewards.client.per_process import in_flight
from nemo_gym_grpc.shared.contract import MAX_MESSAGE_BYTES, MAX_SENDABLE_ITEM_BYTES
from nemo_gym_grpc.shared.reasons import ITEM_TOO_LARGE
from nemo_gym_grpc.v1 import rollout_pb2, rollout_pb2_grpc, verify_pb2, verify_pb2_grpc


class _Result(Protocol):
    """A VerifyResponse or RunResponse: what `Call` reads of a result (of an item:
    `resend.Item`)."""

    @property
    def request_id(self) -> str: ...

    @property
    def error(self) -> status_pb2.Status: ...

    def HasField(self, field_name: Literal["error"]) -> bool: ...  # noqa: N802 (protobuf's name)


Req = TypeVar("Req", bound=resend.Item)
Res = TypeVar("Res", bound=_Result)
Msg = TypeVar("Msg")


@dataclass(frozen=True)
class Rpc(Generic[Req, Res, Msg]):
    """One streaming RPC of the contract, as `Call` uses it.

    Attributes:
        name: the method's name, for messages ("VerifyStream", "RunStream").
        message: one stream request message from a chunk of items.
        sync_method: the stub's stream-stream method on a shared `channels.Channel`.
        aio_method: the same on a `grpc.aio.Channel`.
        resend_taken: whether a broken stream's unanswered items are all sent again, or only
            those gRPC had not taken (`resend.Streams`).
    """

    name: str
    message: Callable[[list[Req]], Msg]
    sync_method: Callable[[channels.Channel], Callable[..., Any]]
    aio_method: Callable[[grpc.aio.Channel], Callable[..., Any]]
    resend_taken: bool


VERIFY: Rpc[verify_pb2.VerifyRequest, verify_pb2.VerifyResponse, verify_pb2.VerifyStreamRequest]
VERIFY = Rpc(
    "VerifyStream",
    lambda items: verify_pb2.VerifyStreamRequest(items=items),
    lambda channel: channel.stub.VerifyStream,
    lambda channel: verify_pb2_grpc.VerifyServiceStub(channel).VerifyStream,
    resend_taken=True,
)
RUN: Rpc[rollout_pb2.RunRequest, rollout_pb2.RunResponse, rollout_pb2.RunStreamRequest]
RUN = Rpc(
    "RunStream",
    lambda items: rollout_pb2.RunStreamRequest(items=items),
    lambda channel: channel.rollouts.RunStream,
    lambda channel: rollout_pb2_grpc.RolloutServiceStub(channel).RunStream,
    resend_taken=False,  # a rollout is sent again only where its /run cannot have started
)


class Call(Generic[Req, Res, Msg]):
    """One streaming call and its bookkeeping, the same for both RPCs and both faces (`send`,
    `asend`): one outcome per request, by request_id.

    Items go in messages of at most 64; a broken stream's unanswered items go out again on a
    new one (`resend.py`). Per-item errors become `Failure`s. If the call fails as a whole
    (deadline, bridge gone for good, no connection, token refused), every item without a
    result gets that call's `Failure` (`whole_call`). An item bigger than the message limit
    fails alone (INVALID_ARGUMENT / ITEM_TOO_LARGE) without being sent. `__init__` books the
    items (`add`; a long-lived call, `live.py`, books more as they come and `take`s each
    outcome as it arrives), `start` gives a stream's messages and the time left, `on_message`
    records results, `reading` the stream's own failure (`on_no_connection`: no connection),
    `resend` decides on another stream, `finish` returns every outcome.

    Args:
        rpc: `VERIFY` (outcomes: `VerifyResponse` or `Failure`) or `RUN` (`RunResponse`, its
            `rollout` set, or `Failure`).
        target: the bridge's gRPC target ("host:port", "ipv4:A:P,B:P", "dns:///name:port").
        requests: items with unique `request_id`s.
        timeout: gRPC deadline of the whole call, seconds from now (it bounds every item).
        connect_timeout: most seconds to wait for a connection to the bridge (bounded by
            `timeout`); a bridge that is still starting is waited for, not failed at once.
        security: TLS files and token (`settings.security`); default plaintext, no token.
        refused_fails: (`asend`) a refused connection fails at once; no stream waits for the bridge.

    Raises:
        ValueError: two requests share a `request_id`.
    """

    def __init__(
        self,
        rpc: Rpc[Req, Res, Msg],
        target: str,
        requests: Sequence[Req],
        *,
        timeout: float,
        connect_timeout: float,
        security: Security = channels.PLAINTEXT,
        refused_fails: bool = False,
    ) -> None:
        self.rpc = rpc
        self.waits_for_bridge = not refused_fails  # `asend`: its connection check, its streams
        self.target = target
        self.security = security
        self.metadata = security.metadata()
        self.timeout = timeout
        self.connect_wait = min(connect_timeout, timeout)
        self.deadline = time.monotonic() + timeout
        self.outcomes: dict[str, Res | Failure] = {}
        self.failure: Failure | None = None
        self.sent: set[str] = set()
        self.sendable = self.add(requests)
        self.streams = resend.Streams(self.sendable, rpc.resend_taken)

    def add(self, requests: Sequence[Req]) -> list[Req]:
        """Book `requests`; those to send are returned (the others fail: ITEM_TOO_LARGE)."""
        sendable: list[Req] = []
        for request in requests:
            if request.request_id in self.sent or request.request_id in self.outcomes:
                raise ValueError(f"duplicate request_id {request.request_id!r}")
            size = request.ByteSize()
            if size > MAX_SENDABLE_ITEM_BYTES:
                self.outcomes[request.request_id] = Failure(
                    "INVALID_ARGUMENT",
                    ITEM_TOO_LARGE,
                    f"item is {size} bytes; the gRPC message limit is {MAX_MESSAGE_BYTES} bytes",
                )
            else:
                self.sent.add(request.request_id)
                sendable.append(request)
        return sendable

    def take(self, request_id: str) -> Res | Failure:
        """`request_id`'s outcome, dropped from the books (KeyError: none yet)."""
        self.sent.discard(request_id)
        return self.outcomes.pop(request_id)

    def left(self) -> float:
        """Seconds left until the call's deadline (0 when past)."""
        return max(self.deadline - time.monotonic(), 0.0)

    def start(self) -> tuple[Iterator[Msg], float]:
        """The current stream's messages and the seconds left for the call."""
        return self.streams.messages(self.rpc.message), self.left()

    def on_message(self, results: Iterable[Res]) -> None:
        """Record a message's results. Raises ProtocolError for an unknown or repeated id."""
        for result in results:
            request_id = result.request_id
            if request_id not in self.sent or request_id in self.outcomes:
                kind = "unknown" if request_id not in self.sent else "duplicate"
                raise ProtocolError(
                    f"bridge at {self.target} sent a result for {kind} request_id "
                    f"{request_id[:100]!r}"
                )
            error = result.error if result.HasField("error") else None
            self.outcomes[request_id] = result if error is None else Failure.from_status(error)

    @contextlib.contextmanager
    def reading(self, responses: stopping.Cancellable) -> Iterator[None]:
        """Around reading the call's `responses`: a failed call is recorded as the call's own
        failure; a ProtocolError cancels the call and propagates."""
        try:
            yield
        except ProtocolError:
            responses.cancel()
            raise
        except grpc.RpcError as error:
            self.failure = Failure.from_rpc_error(error)

    def on_no_connection(self, refused: bool = False) -> None:
        """No connection within `connect_wait` (or `refused`): the call was not started."""
        why = ": it refused the connection" if refused else f" within {self.connect_wait:g} s"
        self.failure = Failure(
            "DEADLINE_EXCEEDED" if self.connect_wait >= self.timeout else "UNAVAILABLE",
            None,
            f"no connection to the bridge at {self.target}{why}",
        )

    def resend(self) -> bool:
        """After a stream: True if its unanswered items go on another (`resend.py`), else False."""
        unanswered = [i for i in self.streams.pending if i.request_id not in self.outcomes]
        where = f"{self.rpc.name} to {self.target}"
        again, kept = self.streams.after_break(self.failure, unanswered, self.left(), where)
        if self.failure is None or not again:
            return False
        lost = replace(self.failure, whole_call=True)  # those that may have started stay failed
        self.outcomes.update(dict.fromkeys([i.request_id for i in kept], lost))
        self.failure = None
        return True

    def finish(self) -> dict[str, Res | Failure]:
        """{request_id: outcome} for every request; the items without a result get the call's
        failure, marked `whole_call`.

        Raises:
            ProtocolError: items are unanswered although the call ended OK.
        """
        missing = [request_id for request_id in self.sent if request_id not in self.outcomes]
        if missing and self.failure is None:
            raise ProtocolError(
                f"bridge at {self.target} ended {self.rpc.name} OK with {len(missing)} of "
                f"{len(self.sent)} items unanswered"
            )
        if missing and self.failure is not None:
            failure = replace(self.failure, whole_call=True)
            self.outcomes.update(dict.fromkeys(missing, failure))
        return self.outcomes


def send(call: Call[Req, Res, Msg]) -> dict[str, Res | Failure]:
    """Send `call`'s requests over one call of its RPC (grpcio, the process's shared channel
    to its target); {request_id: outcome} for every request (`Call.finish`). The caller's
    `stopping.Stopper` (if any) can end it from another thread: its items fail CANCELLED.

    Raises:
        ProtocolError: the bridge answered an unknown or already answered `request_id`, or
            ended the stream OK with items unanswered.
    """
    if not call.sendable:
        return call.finish()
    while True:  # each stream on the channel `shared` gives now (`ray:`: it may change)
        channel = channels.shared(call.target, call.security)
        if not channel.wait_ready(min(call.connect_wait, call.left())):
            call.on_no_connection()
            return call.finish()
        messages, left = call.start()
        responses = call.rpc.sync_method(channel)(
            messages, timeout=left, metadata=call.metadata, wait_for_ready=True
        )
        with call.reading(responses), stopping.watch(responses), in_flight():
            for message in responses:
                call.on_message(message.results)
        if not call.resend():
            return call.finish()


async def asend(call: Call[Req, Res, Msg]) -> dict[str, Res | Failure]:
    """`send` for asyncio: the same outcomes and errors, over grpc.aio on a channel of its own,
    closed before returning or when cancelled (cancelling the coroutine cancels the call, and
    the bridge cancels its items' `/verify` or `/run` requests)."""
    if not call.sendable:
        return call.finish()
    while True:  # each stream on a channel of its own
        async with channels.aio_channel(call.target, call.security) as channel:
            wait = min(call.connect_wait, call.left())
            ready = await channels.ready(channel, wait, refused_fails=not call.waits_for_bridge)
            if not ready:
                call.on_no_connection(refused=ready is False)
                return call.finish()
            messages, left = call.start()
            responses = call.rpc.aio_method(channel)(
                messages, timeout=left, metadata=call.metadata, wait_for_ready=call.waits_for_bridge
            )
            with call.reading(responses):
                async for message in responses:
                    call.on_message(message.results)
        if not call.resend():
            return call.finish()


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
        refused_fails: a refused async call fails at once (`score`: a dead bridge's port).
    """

    target: str | None
    spec: Callable[[], embedded.BridgeSpec]
    security: Security
    timeout: float
    connect_timeout: float
    refused_fails: bool = False

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
            ValueError: `target` or an environment variable is invalid (the message names it).
        """
        configured = settings.check_target(target, "target") if target else settings.target()
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
        self, rpc: Rpc[Req, Res, Msg], address: str, requests: Sequence[Req]
    ) -> Call[Req, Res, Msg]:
        """A `Call` of `requests` to the bridge at `address`, on this route's terms."""
        return Call(
            rpc,
            address,
            requests,
            timeout=self.timeout,
            connect_timeout=self.connect_timeout,
            security=self.security,
            refused_fails=self.refused_fails,
        )

    def send(self, rpc: Rpc[Req, Res, Msg], requests: Sequence[Req]) -> dict[str, Res | Failure]:
        """{request_id: outcome} of `requests` sent over one `rpc` call to this route's bridge
        (`Call`, `send`); {} without a call (and without starting a bridge) when
        there is nothing to send.

        Raises:
            ValueError: two requests share a `request_id`.
            RuntimeError: the embedded bridge could not be started.
            ProtocolError: the bridge broke the stream's contract.
        """
        if not requests:
            return {}
        return send(self.call(rpc, self.address(), requests))

    async def asend(
        self, rpc: Rpc[Req, Res, Msg], requests: Sequence[Req]
    ) -> dict[str, Res | Failure]:
        """`send` for asyncio (`asend`; an embedded bridge starts in a worker thread)."""
        if not requests:
            return {}
        return await asend(self.call(rpc, await self.aaddress(), requests))
