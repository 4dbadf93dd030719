"""NeMo Gym sessions through the bridge's `SessionService`, for trainers that run the agent loop
themselves (docs/sessions.md): `SessionClient` / `Session` (sync), `AsyncSessionClient` /
`AsyncSession` (grpc.aio).

    with SessionClient("127.0.0.1:50051") as client:
        with client.open("example_session_state_mgmt", row) as session:
            session.call_tool("increment_counter", {"count": 2})   # -> {"success": True}
            result = session.verify(completion="2")                 # a VerifyResponse
        # leaving the block closed the session (CloseSession)

A client holds one channel whose calls all go to one bridge (`pick_first` over the target's
addresses): a session lives in the bridge that opened it, so its calls must not rotate among
bridges. Any number of sessions share that channel. Every failed call raises `SessionError`
with the bridge's typed failure (`outcomes.Failure`: code, reason, message); a masked sample in
`verify` is such a failure, never a reward.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import grpc

from nemo_gym_grpc.rewards.client import settings
from nemo_gym_grpc.rewards.client.channels import SESSION_OPTIONS, Security
from nemo_gym_grpc.rewards.client.outcomes import Failure
from nemo_gym_grpc.v1 import session_pb2, session_pb2_grpc, verify_pb2

# Seconds one session call may take by default (the bridge cuts its upstream call to it).
DEFAULT_TIMEOUT = 60.0
SEED_KINDS = {
    "auto": session_pb2.SEED_KIND_AUTO_UNSPECIFIED,
    "legacy": session_pb2.SEED_KIND_LEGACY,
    "typed": session_pb2.SEED_KIND_TYPED,
}


class SessionError(Exception):
    """A session call that failed. `failure` says how (`outcomes.Failure`: `code`, `reason`
    such as "SESSION_NOT_FOUND", "UNKNOWN_TOOL", "UPSTREAM_MASKED_SAMPLE", `message`)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"{failure.cause}: {failure.message}")
        self.failure = failure


def open_request(
    resources_server: str,
    row: Mapping[str, Any] | None,
    *,
    seed_kind: str = "auto",
    rollout_id: str = "",
    lease_seconds: float = 0.0,
) -> session_pb2.OpenSessionRequest:
    """The OpenSessionRequest of `row` (a NeMo Gym dataset row; None = `{}`) on
    `resources_server`; `seed_kind` is "auto", "legacy" or "typed" (session.proto says each).

    Raises:
        ValueError: an unknown `seed_kind`.
    """
    if seed_kind not in SEED_KINDS:
        raise ValueError(f"seed_kind must be one of {sorted(SEED_KINDS)}, got {seed_kind!r}")
    return session_pb2.OpenSessionRequest(
        resources_server=resources_server,
        row_json=json.dumps(dict(row or {})),
        seed_kind=SEED_KINDS[seed_kind],
        rollout_id=rollout_id,
        lease_seconds=lease_seconds,
    )


def verify_request(
    session_id: str,
    *,
    response: Mapping[str, Any] | None = None,
    completion: str = "",
    row: Mapping[str, Any] | None = None,
    include_reply: bool = False,
    close: bool = False,
) -> session_pb2.VerifySessionRequest:
    """The VerifySessionRequest of one answer: `response` (an OpenAI Responses object) or else
    `completion` (its text), scored against `row` (the dataset row; None = `{}`)."""
    item = verify_pb2.VerifyRequest(
        request_id=session_id,
        completion=completion,
        row_json=json.dumps(dict(row or {})),
        include_reply=include_reply,
    )
    if response is not None:
        item.response_json = json.dumps(dict(response))
    return session_pb2.VerifySessionRequest(session_id=session_id, item=item, close=close)


def tool_request(
    session_id: str, tool: str, arguments: Mapping[str, Any] | None
) -> session_pb2.CallToolRequest:
    """The CallToolRequest of `tool` with `arguments` (a JSON object; None = `{}`)."""
    text = json.dumps(dict(arguments or {}))
    return session_pb2.CallToolRequest(session_id=session_id, tool=tool, arguments_json=text)


def opened(reply: session_pb2.OpenSessionResponse) -> tuple[str, dict[str, Any]]:
    """(session id, the `/seed_session` reply as a dict) of a successful reply.

    Raises:
        SessionError: the session was not opened.
    """
    if reply.WhichOneof("outcome") != "session_id":
        raise SessionError(Failure.from_status(reply.error))
    seeded = json.loads(reply.seed_reply_json) if reply.seed_reply_json else {}
    return reply.session_id, seeded if isinstance(seeded, dict) else {}


def tool_output(reply: session_pb2.CallToolResponse) -> Any:
    """The tool's reply, parsed from JSON.

    Raises:
        SessionError: the tool call failed.
    """
    if reply.WhichOneof("outcome") != "output_json":
        raise SessionError(Failure.from_status(reply.error))
    return json.loads(reply.output_json)


def verified(reply: session_pb2.VerifySessionResponse) -> verify_pb2.VerifyResponse:
    """The scored result (its `reward` set).

    Raises:
        SessionError: the item has no reward (a masked sample, an upstream failure, ...).
    """
    if reply.result.WhichOneof("outcome") != "reward":
        raise SessionError(Failure.from_status(reply.result.error))
    return reply.result


def step_request(
    session_id: str,
    *,
    response: Mapping[str, Any] | None = None,
    completion: str = "",
    row: Mapping[str, Any] | None = None,
) -> session_pb2.StepRequest:
    """The StepRequest of one action in a step-wise session: `response` (an OpenAI Responses
    object) or else `completion` (its text), with `row` (the dataset row; None = `{}`)."""
    item = verify_request(session_id, response=response, completion=completion, row=row).item
    return session_pb2.StepRequest(session_id=session_id, item=item)


def stepped(reply: session_pb2.StepResponse) -> session_pb2.StepResult:
    """What the environment answered (observation, reward, terminated, truncated, info).

    Raises:
        SessionError: the step failed (e.g. NOT_STEP_WISE, SESSION_NOT_FOUND, upstream).
    """
    if reply.WhichOneof("outcome") != "result":
        raise SessionError(Failure.from_status(reply.error))
    return reply.result


def _open_channel(kind: Any, target: str, security: Security) -> Any:
    """A channel of `kind` (the `grpc` or `grpc.aio` module) to `target` with SESSION_OPTIONS and
    `security`'s credentials."""
    credentials = security.credentials()
    if credentials is None:
        return kind.insecure_channel(target, options=SESSION_OPTIONS)
    return kind.secure_channel(target, credentials, options=SESSION_OPTIONS)


def _security(target: str | None, security: Security | None) -> tuple[str, Security]:
    found = target or settings.target()
    if not found:
        raise ValueError(
            f"no bridge to open sessions on: pass target= or set {settings.TARGET_ENV}"
        )
    return settings.check_target(found, "target"), security or settings.security()


class _Opened:
    """What `Session` and `AsyncSession` know of one open session.

    Attributes:
        id: its id (its `resources_session_id` upstream).
        resources_server: where it lives.
        seed_reply: the `/seed_session` reply (0.7's `resources_tools`), or `/reset`'s.
        lease_seconds: how long it may stay idle before the bridge closes it.
        step_wise: an episode of a step-wise server: act with `step`, not `verify`.
    """

    def __init__(self, client: Any, reply: session_pb2.OpenSessionResponse, server: str) -> None:
        self._client = client
        self.id, self.seed_reply = opened(reply)
        self.resources_server = server
        self.lease_seconds = reply.lease_seconds
        self.step_wise = reply.step_wise


class Session(_Opened):
    """One open session (from `SessionClient.open`; attributes: `_Opened`); a context manager
    that closes it."""

    _client: SessionClient

    def call_tool(
        self, tool: str, arguments: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        """The reply of the resources server's tool `tool` (`POST /<tool>`), parsed.

        Raises:
            SessionError: the call failed (e.g. UNKNOWN_TOOL, SESSION_NOT_FOUND).
        """
        call = self._client.stub.CallTool
        return tool_output(self._client.call(call, tool_request(self.id, tool, arguments), timeout))

    def verify(self, timeout: float | None = None, **answer: Any) -> verify_pb2.VerifyResponse:
        """Score an answer in this session (`verify_request`'s keywords: `response` or
        `completion`, `row`, `include_reply`, `close`).

        Raises:
            SessionError: no reward (masked sample, upstream failure, ...).
        """
        call = self._client.stub.VerifySession
        return verified(self._client.call(call, verify_request(self.id, **answer), timeout))

    def step(self, timeout: float | None = None, **action: Any) -> session_pb2.StepResult:
        """Act in this step-wise session (`step_request`'s keywords: `response` or
        `completion`, `row`): the environment's observation, reward, terminated, truncated.

        Raises:
            SessionError: the step failed (NOT_STEP_WISE on a server that is not step-wise).
        """
        call = self._client.stub.Step
        return stepped(self._client.call(call, step_request(self.id, **action), timeout))

    def close(self) -> bool:
        """Close it (`/close_session` upstream where the server has it); False when it was
        closed already (by `verify(close=True)`, its lease, or an earlier call)."""
        request = session_pb2.CloseSessionRequest(session_id=self.id)
        return bool(self._client.call(self._client.stub.CloseSession, request, None).closed)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SessionClient:
    """Sessions on one bridge, over one channel of its own (see the module docstring).

    Args:
        target: the bridge's gRPC target; None = `NEMO_GYM_GRPC_TARGET`.
        security: TLS files and token; None = the environment's (`settings.security`).
        timeout: default seconds per call (DEFAULT_TIMEOUT).

    Raises:
        ValueError: no target, or the environment's settings are invalid.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        security: Security | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        target, self._security = _security(target, security)
        self.channel: grpc.Channel = _open_channel(grpc, target, self._security)
        self.stub = session_pb2_grpc.SessionServiceStub(self.channel)
        self.timeout = timeout

    def open(
        self,
        resources_server: str,
        row: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
        **seed: Any,
    ) -> Session:
        """Open a session with `row` (`open_request`'s keywords: `seed_kind`, `rollout_id`,
        `lease_seconds`).

        Raises:
            SessionError: not opened (e.g. UPSTREAM_SESSION_FAILED, TOO_MANY_SESSIONS).
        """
        request = open_request(resources_server, row, **seed)
        return Session(self, self.call(self.stub.OpenSession, request, timeout), resources_server)

    def call(self, method: Any, request: Any, timeout: float | None) -> Any:
        """`method(request)` with this client's deadline and token.

        Raises:
            SessionError: the call failed as a whole (bridge unreachable, deadline, token).
        """
        try:
            return method(
                request, timeout=timeout or self.timeout, metadata=self._security.metadata()
            )
        except grpc.RpcError as exc:
            raise SessionError(Failure.from_rpc_error(exc)) from None

    def close(self) -> None:
        """Close the channel (sessions still open stay so until their lease ends)."""
        self.channel.close()

    def __enter__(self) -> SessionClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncSession(_Opened):
    """`Session` for `AsyncSessionClient`: the same attributes, its calls coroutines; an async
    context manager that closes it."""

    _client: AsyncSessionClient

    async def call_tool(
        self, tool: str, arguments: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        """As `Session.call_tool`."""
        request = tool_request(self.id, tool, arguments)
        return tool_output(await self._client.call(self._client.stub.CallTool, request, timeout))

    async def verify(
        self, timeout: float | None = None, **answer: Any
    ) -> verify_pb2.VerifyResponse:
        """As `Session.verify`."""
        request = verify_request(self.id, **answer)
        return verified(await self._client.call(self._client.stub.VerifySession, request, timeout))

    async def step(self, timeout: float | None = None, **action: Any) -> session_pb2.StepResult:
        """As `Session.step`."""
        request = step_request(self.id, **action)
        return stepped(await self._client.call(self._client.stub.Step, request, timeout))

    async def close(self) -> bool:
        """As `Session.close`."""
        request = session_pb2.CloseSessionRequest(session_id=self.id)
        reply = await self._client.call(self._client.stub.CloseSession, request, None)
        return bool(reply.closed)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class AsyncSessionClient:
    """`SessionClient` on grpc.aio: made (and used) on the event loop that runs its calls;
    the same arguments and errors."""

    def __init__(
        self,
        target: str | None = None,
        *,
        security: Security | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        target, self._security = _security(target, security)
        self.channel: grpc.aio.Channel = _open_channel(grpc.aio, target, self._security)
        self.stub = session_pb2_grpc.SessionServiceStub(self.channel)
        self.timeout = timeout

    async def open(
        self,
        resources_server: str,
        row: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
        **seed: Any,
    ) -> AsyncSession:
        """As `SessionClient.open`."""
        request = open_request(resources_server, row, **seed)
        reply = await self.call(self.stub.OpenSession, request, timeout)
        return AsyncSession(self, reply, resources_server)

    async def call(self, method: Any, request: Any, timeout: float | None) -> Any:
        """As `SessionClient.call`."""
        try:
            return await method(
                request, timeout=timeout or self.timeout, metadata=self._security.metadata()
            )
        except grpc.RpcError as exc:
            raise SessionError(Failure.from_rpc_error(exc)) from None

    async def close(self) -> None:
        """As `SessionClient.close`."""
        await self.channel.close()

    async def __aenter__(self) -> AsyncSessionClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
