"""The checks and pure helpers of the session flow (flows/session.py): what a SessionService
request must be before any upstream call, and how cookies merge. Pure: no I/O, no state; a
failed check is that request's INVALID_ARGUMENT alone.
"""

from __future__ import annotations

import math

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows import checks, verify_checks
from nemo_gym_grpc.bridge.nemo_gym import capabilities
from nemo_gym_grpc.bridge.nemo_gym.sessions import CLOSE_PATH, RESET_PATH, SEED_PATH, STEP_PATH
from nemo_gym_grpc.bridge.nemo_gym.verify import VERIFY_PATH
from nemo_gym_grpc.v1 import session_pb2, verify_pb2

# A session's NeMo Gym routes (not tools; each its own metrics label).
ROUTES = frozenset({SEED_PATH, VERIFY_PATH, CLOSE_PATH, RESET_PATH, STEP_PATH})


def merged_cookies(old: str, fresh: str) -> str:
    """The `Cookie` header `old` ("a=1; b=2") with the cookies of `fresh` replacing theirs
    by name and new ones added."""
    jar: dict[str, str] = {}
    for header in (old, fresh):
        for part in header.split("; "):
            name, equals, value = part.partition("=")
            if equals:
                jar[name] = value
    return "; ".join(f"{name}={value}" for name, value in jar.items())


def as_is(body: bytes, url: str) -> bytes:
    """A reply body as it came (a tool's reply: any JSON)."""
    return body


def typed(kind: int, caps: capabilities.Capabilities) -> bool:
    """Whether an open with seed `kind` sends the typed seed to a replica with `caps`."""
    if kind == session_pb2.SEED_KIND_TYPED:
        return True
    return kind != session_pb2.SEED_KIND_LEGACY and caps.typed_seed_only


def checked_open(request: session_pb2.OpenSessionRequest, max_bytes: int) -> tuple[bytes, float]:
    """The legacy `/seed_session` body of `request` (its row, checked as a VerifyRequest's)
    and its lease (0 = the default)."""
    if request.lease_seconds < 0 or not math.isfinite(request.lease_seconds):
        raise errors.invalid_item(f"lease_seconds must be >= 0, got {request.lease_seconds}")
    item = verify_pb2.VerifyRequest(
        request_id="session",
        resources_server=request.resources_server,
        row_json=request.row_json,
        timeout_seconds=request.timeout_seconds,
        seed_session=True,
    )
    _, seed = verify_checks.check_item(item, max_item_bytes=max_bytes, session_servers=())
    assert seed is not None
    return seed, request.lease_seconds


def checked_tool(request: session_pb2.CallToolRequest, max_bytes: int) -> bytes:
    """The tool's body: its arguments, a JSON object."""
    tool = request.tool
    if not tool or not tool.replace("_", "a").replace("-", "a").isalnum() or not tool.isascii():
        raise errors.invalid_item(f"tool must be letters, digits, _ and -, got {tool[:100]!r}")
    if "/" + tool in ROUTES:
        raise errors.invalid_item(f"{tool!r} is a session route, not a tool")
    checks.check_size(request, max_bytes)
    if not request.arguments_json:
        return b"{}"
    verify_checks.json_object(request.arguments_json, "arguments_json")
    return request.arguments_json.encode("utf-8")


def checked_item(item: verify_pb2.VerifyRequest, name: str) -> verify_pb2.VerifyRequest:
    """A copy of a VerifySession / Step `item` for a session on resources server `name`: its
    server the session's when it names none, no seed of its own."""
    copied = verify_pb2.VerifyRequest()
    copied.CopyFrom(item)
    copied.resources_server = copied.resources_server or name
    copied.seed_session = False
    return copied
