"""The `nemo_gym_grpc.v1.SessionService` implementation (grpc.aio): OpenSession, CallTool,
VerifySession, CloseSession, Step over the session flow (`flows.session.Sessions`).

Each call answers in its response, with the RPC ending OK: the outcome, or `error` (a
`google.rpc.Status` with one ErrorInfo, `errors.ItemError.to_status`). Each request counts
against the bridge's byte budget while it runs (`budget.py`), as a unary Verify does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows.session import Sessions
from nemo_gym_grpc.bridge.flows.verify import Verifier, scored_response
from nemo_gym_grpc.bridge.rpc.budget import Budget, item_bytes
from nemo_gym_grpc.bridge.rpc.handlers import add_service
from nemo_gym_grpc.bridge.rpc.streams import call_deadline
from nemo_gym_grpc.shared.contract import SESSION_SERVICE
from nemo_gym_grpc.v1 import session_pb2, session_pb2_grpc

T = TypeVar("T")
R = TypeVar("R", bound=Message)


class SessionService(session_pb2_grpc.SessionServiceServicer):
    """Serves the session calls on one event loop.

    Args:
        sessions: the session flow.
        verifier: the verify flow (its failed-item counting, for VerifySession).
        budget: the bridge's byte budget.
    """

    def __init__(self, sessions: Sessions, verifier: Verifier, budget: Budget) -> None:
        self._sessions = sessions
        self._verifier = verifier
        self._budget = budget

    async def OpenSession(
        self, request: session_pb2.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.OpenSessionResponse:
        try:
            session_id, session, reply = await self._held(
                request, self._sessions.open, call_deadline(context)
            )
        except Exception as exc:
            return _failed(session_pb2.OpenSessionResponse, exc, "OpenSession")
        return session_pb2.OpenSessionResponse(
            session_id=session_id,
            seed_reply_json=reply.body.decode("utf-8", "replace"),
            lease_seconds=session.lease,
            latency_seconds=reply.seconds,
            step_wise=session.step_wise,
        )

    async def CallTool(
        self, request: session_pb2.CallToolRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.CallToolResponse:
        try:
            output, seconds = await self._held(
                request, self._sessions.call_tool, call_deadline(context)
            )
        except Exception as exc:
            return _failed(session_pb2.CallToolResponse, exc, "CallTool")
        text = output.decode("utf-8", "replace")
        return session_pb2.CallToolResponse(output_json=text, latency_seconds=seconds)

    async def VerifySession(
        self, request: session_pb2.VerifySessionRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.VerifySessionResponse:
        item = request.item
        try:
            name, scored, seconds = await self._held(
                request, self._sessions.verify, call_deadline(context)
            )
        except Exception as exc:
            error = errors.as_item_error(exc, item.request_id)
            return session_pb2.VerifySessionResponse(result=self._verifier.failed(item, error))
        self._verifier.metrics.item(name, "OK", "")
        return session_pb2.VerifySessionResponse(
            result=scored_response(item.request_id, scored, seconds)
        )

    async def CloseSession(
        self, request: session_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.CloseSessionResponse:
        return session_pb2.CloseSessionResponse(closed=self._sessions.close(request.session_id))

    async def Step(
        self, request: session_pb2.StepRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.StepResponse:
        try:
            result, seconds = await self._held(request, self._sessions.step, call_deadline(context))
        except Exception as exc:
            return _failed(session_pb2.StepResponse, exc, "Step")
        return session_pb2.StepResponse(result=result, latency_seconds=seconds)

    async def _held(
        self, request: R, call: Callable[[R, float | None], Awaitable[T]], deadline: float | None
    ) -> T:
        """`call(request, deadline)`'s result, with `request` counted in the byte budget
        meanwhile (waiting for room first)."""
        await self._budget.room()
        held = item_bytes(request)
        self._budget.take(held)
        try:
            return await call(request, deadline)
        finally:
            self._budget.give(held)


def _failed(response: Callable[..., R], exc: Exception, call: str) -> R:
    """`response` with `error` and `latency_seconds` of what `call` raised
    (`errors.as_item_error`: a bridge bug is logged and answered INTERNAL)."""
    error = errors.as_item_error(exc, call)
    failed = response(latency_seconds=error.latency_seconds)
    failed.error.CopyFrom(error.to_status())  # type: ignore[attr-defined]
    return failed


def add_session_service(service: SessionService, server: grpc.aio.Server) -> None:
    """Register `service` (`handlers.add_service`)."""
    add_service(service, server, SESSION_SERVICE, session_pb2, {})
