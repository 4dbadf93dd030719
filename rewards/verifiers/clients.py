"""The bridge session clients of a verifiers process (the env server's and its tool server's):
one `AsyncSessionClient` per bridge target and event loop, shared by every rollout on it (one
channel, its calls multiplexed over HTTP/2), and the session calls by session id that the
taskset and the toolset make (state crosses their process boundary as JSON: the id, not a
`Session` object)."""

from __future__ import annotations

import asyncio
import json
import weakref
from typing import Any

from nemo_gym_grpc.rewards.client.sessions import (
    AsyncSessionClient,
    step_request,
    stepped,
    tool_output,
    tool_request,
    verified,
    verify_request,
)
from nemo_gym_grpc.v1 import session_pb2, verify_pb2, verify_pb2_grpc

__all__ = [
    "call_tool",
    "close",
    "server_tools",
    "session_client",
    "step",
    "step_wise",
    "verify",
    "verify_request",
]

_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, AsyncSessionClient]]
_clients = weakref.WeakKeyDictionary()
_step_wise: dict[tuple[str, str], bool] = {}  # (bridge target, server) -> step-wise


def session_client(target: str) -> AsyncSessionClient:
    """The running loop's client of the bridge at `target` (made on first use)."""
    per_loop = _clients.setdefault(asyncio.get_running_loop(), {})
    if target not in per_loop:
        per_loop[target] = AsyncSessionClient(target)
    return per_loop[target]


async def server_tools(target: str, server: str, timeout: float) -> list[dict[str, Any]]:
    """The function tools the bridge lists for resources server `server` (ListResourcesServers'
    `function_tools_json`: what a row's `responses_create_params.tools` holds); [] when it
    lists none or does not know the server. Raises grpc.aio.AioRpcError when the call fails."""
    client = session_client(target)
    stub = verify_pb2_grpc.VerifyServiceStub(client.channel)
    listed = await stub.ListResourcesServers(
        verify_pb2.ListResourcesServersRequest(), timeout=timeout
    )
    for entry in listed.resources_servers:
        if entry.name == server:
            return [json.loads(text) for text in entry.function_tools_json]
    return []


async def step_wise(target: str, server: str, timeout: float) -> bool:
    """Whether the bridge lists resources server `server` as step-wise (`/reset` and `/step`;
    ListResourcesServers' `step_wise`), asked once per process and bridge while it knows what
    the server supports; False when it does not know the server or that yet. Raises
    grpc.aio.AioRpcError when the call fails."""
    if (target, server) in _step_wise:
        return _step_wise[target, server]
    client = session_client(target)
    stub = verify_pb2_grpc.VerifyServiceStub(client.channel)
    listed = await stub.ListResourcesServers(
        verify_pb2.ListResourcesServersRequest(), timeout=timeout
    )
    for entry in listed.resources_servers:
        if entry.capabilities_known:
            _step_wise[target, entry.name] = entry.step_wise
    return _step_wise.get((target, server), False)


async def step(
    target: str, session_id: str, row: dict[str, Any], timeout: float, **action: Any
) -> Any:
    """Step with `action` (`step_request`'s `completion`: the model's text, or `response`: a
    Responses object), `row` the dataset row; the `StepResult` (observation, reward,
    terminated, truncated). Raises SessionError."""
    client = session_client(target)
    request = step_request(session_id, row=row, **action)
    return stepped(await client.call(client.stub.Step, request, timeout))


async def verify(
    target: str, request: session_pb2.VerifySessionRequest, timeout: float
) -> verify_pb2.VerifyResponse:
    """VerifySession; the scored result. Raises SessionError (a masked sample among them)."""
    client = session_client(target)
    return verified(await client.call(client.stub.VerifySession, request, timeout))


async def call_tool(
    target: str, session_id: str, tool: str, arguments: dict[str, Any], timeout: float
) -> Any:
    """CallTool; the tool's JSON reply. Raises SessionError (unknown tool, session lost, ...)."""
    client = session_client(target)
    request = tool_request(session_id, tool, arguments)
    return tool_output(await client.call(client.stub.CallTool, request, timeout))


async def close(target: str, session_id: str) -> bool:
    """CloseSession; False when the bridge no longer had it (already closed or expired).
    Raises SessionError when the bridge cannot be reached."""
    client = session_client(target)
    request = session_pb2.CloseSessionRequest(session_id=session_id)
    reply = await client.call(client.stub.CloseSession, request, None)
    return bool(reply.closed)
