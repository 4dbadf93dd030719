"""NeMo Gym sessions: `POST /seed_session` before an item's `/verify`, its cookies, and
`POST /close_session` after it.

NeMo Gym keeps per-rollout state behind a session cookie (Starlette's SessionMiddleware). The
seed call takes the row (the legacy body; 0.7 also takes a typed `ResourcesSeedSessionRequest`,
and some servers take only that) and answers with a `Set-Cookie`, which the item's `/verify`
sends back. The bridge's HTTP session keeps no cookies (DummyCookieJar): an item sends exactly
the cookies its own `/seed_session` reply set, and an item without a session sends none.
0.7's `/close_session` takes `{resources_session_id, episode_id}` (with the cookie).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie
from typing import Any

from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.nemo_gym import codec
from nemo_gym_grpc.bridge.nemo_gym.correlation import episode_id, rollout_id_problem
from nemo_gym_grpc.bridge.nemo_gym.http import Client, post
from nemo_gym_grpc.shared import reasons

log = logging.getLogger(__name__)

SEED_PATH = "/seed_session"
CLOSE_PATH = "/close_session"
# A step-wise (gymnasium-style) server's session: `/reset` with the row opens it, `/step` with
# the row and a response acts in it (observation, reward, terminated, truncated, info).
RESET_PATH = "/reset"
STEP_PATH = "/step"
# Seconds one `/close_session` call may take.
CLOSE_TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class Opened:
    """One session the bridge opens for one attempt of an item: its `resources_session_id`
    and NeMo Gym `EpisodeId` dict."""

    session_id: str
    episode: dict[str, Any]

    @property
    def rollout_id(self) -> str:
        """The episode's rollout id: the item's request_id, or the session id standing in."""
        return str(self.episode["rollout_id"])


def seed_body(verify_body: Mapping[str, Any]) -> bytes:
    """The UTF-8 JSON body of `/seed_session` for an item: its `/verify` body without
    `response` (the row's fields and `responses_create_params`)."""
    row = {key: value for key, value in verify_body.items() if key != "response"}
    return codec.dumps(row)  # a part of a body that encoded: no NaN, no lone surrogate


def reset_body(verify_body: bytes) -> bytes:
    """The UTF-8 JSON body of `/reset` for an item, from its `/verify` body (what `seed_body`
    keeps: the row without `response`)."""
    row = codec.loads(verify_body)
    row.pop("response", None)
    return codec.dumps(row)


def cookie_header(set_cookies: Iterable[str], url: str) -> str:
    """The `Cookie` request header that sends back the cookies a reply set.

    Args:
        set_cookies: the values of the reply's `Set-Cookie` headers (`http.Reply`).
        url: where the reply came from (for the error).

    Returns:
        "name=value; name2=value2" with each value exactly as the server sent it (quoted if it
        was), or "" when the reply set none.

    Raises:
        errors.ItemError: INTERNAL / UPSTREAM_BAD_REPLY when a value does not parse as a
            cookie (Python's `http.cookies`).
    """
    jar: SimpleCookie = SimpleCookie()
    for value in set_cookies:
        try:
            jar.load(value)
        except CookieError:
            raise errors.ItemError(
                code_pb2.INTERNAL,
                reasons.UPSTREAM_BAD_REPLY,
                f"{url} set a cookie that does not parse: {errors.upstream_text(value)}",
                upstreamUrl=url,
            ) from None
    return "; ".join(f"{morsel.key}={morsel.coded_value}" for morsel in jar.values())


def new_session_id() -> str:
    """A fresh `resources_session_id` for one session the bridge opens (it is also a valid
    NeMo Gym rollout id)."""
    return f"nemo-gym-grpc-{uuid.uuid4().hex}"


def typed_seed_body(opened: Opened, taskset: str, task_id: str, legacy: bytes) -> bytes:
    """The UTF-8 JSON body of a typed `ResourcesSeedSessionRequest` for session `opened`:
    `{resources_session_id, episode_id, task_id: {taskset, task_id}, task_data}`, whose
    `task_data` is the legacy body `legacy` (the row and `responses_create_params`, already
    encoded: it is spliced in, not parsed again). `taskset` must not be empty; an empty
    `task_id` is replaced by the session id."""
    head = {
        "resources_session_id": opened.session_id,
        "episode_id": opened.episode,
        "task_id": {"taskset": taskset, "task_id": task_id or opened.session_id},
    }
    return codec.dumps(head)[:-1] + b',"task_data":' + legacy + b"}"


def close_body(session_id: str, episode: Mapping[str, Any]) -> bytes:
    """The UTF-8 JSON body of `ResourcesCloseSessionRequest{resources_session_id,
    episode_id}`."""
    return codec.dumps({"resources_session_id": session_id, "episode_id": episode})


def open_session(request_id: str, attempt: int) -> Opened:
    """A new session for attempt `attempt` (1 = the first) of the item `request_id`: its
    episode's rollout id is `request_id`, or the session id where that is no valid rollout id
    (`correlation.rollout_id_problem`)."""
    session_id = new_session_id()
    rollout_id = session_id if rollout_id_problem(request_id) else request_id
    return Opened(session_id, episode_id(rollout_id, attempt - 1))


class Closer:
    """`POST /close_session` calls in background tasks, so that closing never delays or
    changes an item's result.

    Args:
        client: the bridge's upstream HTTP client.
        record: called once per close with (resources server name, failure reason or "" when
            closed, seconds taken).
        timeout: seconds one close may take (`CLOSE_TIMEOUT`).
    """

    def __init__(
        self,
        client: Client,
        record: Callable[[str, str, float], None],
        timeout: float = CLOSE_TIMEOUT,
    ) -> None:
        self._client = client
        self._record = record
        self._timeout = timeout
        self._tasks: set[asyncio.Task[None]] = set()

    def later(self, url: str, opened: Opened, cookie: str, request_id: str, name: str) -> None:
        """Close `opened` at `url` (the full `/close_session` URL) with the `Cookie` header
        `cookie` ("" for none), on behalf of the item `request_id`; `name` is the resources
        server (for `record`)."""
        task = asyncio.create_task(self._close(url, opened, cookie, request_id, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the closes under way to end (each within its timeout)."""
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def aclose(self) -> None:
        """Cancel the closes still under way (on drain) and wait for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _close(
        self, url: str, opened: Opened, cookie: str, request_id: str, name: str
    ) -> None:
        body = close_body(opened.session_id, opened.episode)
        reason = message = ""
        try:
            reply = await post(
                self._client,
                url,
                body,
                timeout=self._timeout,
                request_id=request_id,
                cookie=cookie,
            )
        except errors.ItemError as exc:
            reason, message, seconds = exc.reason, exc.message, exc.latency_seconds
        else:
            seconds = reply.seconds
            if reply.status != 200:
                reason = reasons.UPSTREAM_HTTP_ERROR
                message = f"{url}: HTTP {reply.status}: {reply.body[:200]!r}"
        self._record(name, reason, seconds)
        if reason:
            log.warning(
                "session %s of request_id=%r not closed: %s",
                opened.session_id,
                request_id[:100],
                message,
            )
