"""The session flow (SessionService): NeMo Gym sessions driven call by call by the trainer.

`open` seeds a session on one replica of a resources server (`/seed_session`, legacy or typed
body; `/reset` with the row on a step-wise server) and keeps it in the bridge's table under its
id (its `resources_session_id`); `call_tool` posts to `/<tool>`, `verify` to `/verify`, `step`
to a step-wise server's `/step`, each with the session's latest cookies (NeMo Gym keeps session
state in a signed cookie a reply may set again) on the replica that seeded it;
`close` takes it out of the table and posts `/close_session` where the replica has it. A
session leaves the table exactly once: on `close`, after a step that ended the episode
(terminated or truncated), when it was idle (no call in progress) past its lease, or when the
bridge stops (`aclose`); each way closes it upstream.

Each call is one upstream POST on the one upstream call path (`upstream.post`), in one of the
replica's slots, with its own timeout cut to the RPC deadline; none is retried (a tool call or
a verify in a session may change its state). Failures are `errors.ItemError`s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows import attempts, upstream, verify_checks
from nemo_gym_grpc.bridge.flows.balancer import Balancer, Replica, SlotTimeout
from nemo_gym_grpc.bridge.flows.session_checks import (
    ROUTES,
    as_is,
    checked_item,
    checked_open,
    checked_tool,
    merged_cookies,
    typed,
)
from nemo_gym_grpc.bridge.flows.upstreams import Upstreams
from nemo_gym_grpc.bridge.nemo_gym import capabilities, http, sessions
from nemo_gym_grpc.bridge.nemo_gym.correlation import episode_id
from nemo_gym_grpc.bridge.nemo_gym.http import Reply
from nemo_gym_grpc.bridge.nemo_gym.scores import Scored
from nemo_gym_grpc.bridge.nemo_gym.sessions import CLOSE_PATH, RESET_PATH, SEED_PATH, STEP_PATH
from nemo_gym_grpc.bridge.nemo_gym.steps import read_step_reply
from nemo_gym_grpc.bridge.nemo_gym.verify import VERIFY_PATH, read_verify_reply
from nemo_gym_grpc.bridge.process.metrics import Metrics
from nemo_gym_grpc.shared import reasons
from nemo_gym_grpc.v1 import session_pb2

log = logging.getLogger(__name__)

# Seconds between two looks for sessions idle past their lease.
SWEEP_EVERY = 1.0


@dataclass(slots=True)
class Session:
    """One open session: its resources server `name`, the `replica` that seeded it, its
    NeMo Gym ids (`opened`), its latest `Cookie` header, whether the replica has
    `/close_session`, its lease and idle time (seconds; `time.monotonic()`), the calls in
    progress (`busy`: no lease runs out under a call), and whether it is step-wise."""

    name: str
    replica: Replica
    opened: sessions.Opened
    cookie: str
    closes: bool
    lease: float
    idle_since: float = field(default_factory=time.monotonic)
    busy: int = 0
    step_wise: bool = False


class Sessions:
    """The sessions of one bridge (see the module docstring).

    Args:
        upstreams: the resources servers' routing table.
        client: the bridge's upstream HTTP client.
        balancer: the replicas and their slots (shared with the verify flow).
        catalog: what each replica supports (shared with the verify flow).
        metrics: where calls, tool calls and open sessions are counted.
        default_timeout: seconds of one call whose request sets none (`--verify-timeout`).
        max_item_bytes: largest request accepted, serialized bytes (`--max-item-mb`).
        lease: default seconds a session may stay idle (`--session-lease`).
        max_sessions: most sessions open at once (`--max-sessions`).
    """

    def __init__(
        self,
        upstreams: Upstreams,
        client: http.Client,
        *,
        balancer: Balancer,
        catalog: capabilities.Catalog,
        metrics: Metrics,
        default_timeout: float,
        max_item_bytes: int,
        lease: float,
        max_sessions: int,
    ) -> None:
        self.upstreams = upstreams
        self._client = client
        self._balancer = balancer
        self._catalog = catalog
        self.metrics = metrics
        self._default_timeout = default_timeout
        self._max_item_bytes = max_item_bytes
        self.lease = lease
        self.max_sessions = max_sessions
        self._open: dict[str, Session] = {}
        self._opening = 0  # opens in flight (they count toward max_sessions)
        self._closer = sessions.Closer(client, self._closed)
        self._sweeper: asyncio.Task[None] | None = None
        metrics.watch_sessions(lambda: len(self._open))

    async def open(
        self, request: session_pb2.OpenSessionRequest, deadline: float | None
    ) -> tuple[str, Session, Reply]:
        """Seed a session: (its id, the session, the `/seed_session` or `/reset` reply).

        Raises:
            errors.ItemError: INVALID_ARGUMENT / INVALID_ITEM (no server, a row that is not a
                JSON object, a negative lease), NOT_FOUND / UNKNOWN_RESOURCES_SERVER,
                RESOURCE_EXHAUSTED / TOO_MANY_SESSIONS, or the seed's failure with reason
                UPSTREAM_SESSION_FAILED.
        """
        if len(self._open) + self._opening >= self.max_sessions:
            raise errors.ItemError(
                code_pb2.RESOURCE_EXHAUSTED,
                reasons.TOO_MANY_SESSIONS,
                f"the bridge holds {len(self._open)} open sessions and opens {self._opening}, "
                "its --max-sessions; close sessions that are done",
                limit=str(self.max_sessions),
            )
        self._opening += 1  # an open in flight counts toward the limit
        try:
            return await self._seeded(request, deadline)
        finally:
            self._opening -= 1

    async def _seeded(
        self, request: session_pb2.OpenSessionRequest, deadline: float | None
    ) -> tuple[str, Session, Reply]:
        """`open` past the limit check: the session seeded and in the table."""
        legacy, lease = checked_open(request, self._max_item_bytes)
        name = request.resources_server
        replica = self._balancer.pick(await self.upstreams.resolve(name))
        wait = attempts.wait_within(capabilities.LEARN_TIMEOUT, deadline)
        caps = await self._catalog.of(replica.url, wait)
        session_id = sessions.new_session_id()
        opened = sessions.Opened(session_id, episode_id(request.rollout_id or session_id, 0))
        body, path = legacy, RESET_PATH if caps.step_wise else SEED_PATH
        if not caps.step_wise and typed(request.seed_kind, caps):
            task = request.taskset or name
            body = sessions.typed_seed_body(opened, task, request.task_id, legacy)
        lease = lease or self.lease
        session = Session(
            name, replica, opened, "", caps.close_session, lease, step_wise=caps.step_wise
        )
        try:
            reply = await self._post(session, path, body, request.timeout_seconds, deadline)
            if reply.status != 200:
                url = replica.url + path
                raise errors.http_status_error(
                    reply.status, url, reply.body, reasons.UPSTREAM_SESSION_FAILED
                )
        except errors.ItemError as exc:
            exc.reason = reasons.UPSTREAM_SESSION_FAILED
            if not isinstance(exc, attempts.NotSent):
                self._close_upstream(session)  # it may have reached the server
            raise
        except asyncio.CancelledError:  # the caller left: a seed that may have landed is closed
            self._close_upstream(session)
            raise
        self._open[session_id] = session
        self._start_sweeping()
        return session_id, session, reply

    async def call_tool(
        self, request: session_pb2.CallToolRequest, deadline: float | None
    ) -> tuple[bytes, float]:
        """The tool's reply body and the call's seconds.

        Raises:
            errors.ItemError: NOT_FOUND / SESSION_NOT_FOUND, INVALID_ARGUMENT / INVALID_ITEM
                (a bad tool name or arguments; the server's 400 or 422), NOT_FOUND /
                UNKNOWN_TOOL (the server has no such route), or the upstream failure.
        """
        session = self._session(request.session_id)
        body = checked_tool(request, self._max_item_bytes)
        route = "/" + request.tool
        with _busy(session):
            reply = await self._post(session, route, body, request.timeout_seconds, deadline)
        if reply.status in (404, 405):
            self.metrics.tool_call(session.name, "(unknown)", "UNKNOWN_TOOL")
            raise errors.ItemError(
                code_pb2.NOT_FOUND,
                reasons.UNKNOWN_TOOL,
                f"{session.replica.url} has no tool {request.tool!r} (HTTP {reply.status})",
                upstreamUrl=session.replica.url,
                tool=request.tool,
            )
        try:
            output = upstream.read(reply, session.replica.url + route, as_is)
        except errors.ItemError as exc:
            self.metrics.tool_call(session.name, request.tool, code_pb2.Code.Name(exc.code))
            raise
        self.metrics.tool_call(session.name, request.tool, "OK")
        return output, reply.seconds

    async def verify(
        self, request: session_pb2.VerifySessionRequest, deadline: float | None
    ) -> tuple[str, Scored, float]:
        """(the session's resources server, the score of `request.item` in the session, its
        `/verify` call's seconds); the session is closed after it when `request.close` is
        set.

        Raises:
            errors.ItemError: NOT_FOUND / SESSION_NOT_FOUND, what `verify_checks.check_item`
                raises, or the `/verify` failure (as for VerifyService).
        """
        session = self._session(request.session_id)
        try:
            _kind(session, step_wise=False)
            item = checked_item(request.item, session.name)
            payload, _ = verify_checks.check_item(
                item, max_item_bytes=self._max_item_bytes, session_servers=()
            )
            with _busy(session):
                reply = await self._post(
                    session, VERIFY_PATH, payload, item.timeout_seconds, deadline
                )
            url = session.replica.url + VERIFY_PATH
            scored = upstream.read(reply, url, read_verify_reply, item.include_reply)
            return session.name, scored, reply.seconds
        finally:
            if request.close:
                self.close(request.session_id)

    async def step(
        self, request: session_pb2.StepRequest, deadline: float | None
    ) -> tuple[session_pb2.StepResult, float]:
        """(what the environment answered to `request.item`'s action, the `/step` call's
        seconds) in a step-wise session; one that ends the episode closes the session.

        Raises:
            errors.ItemError: NOT_FOUND / SESSION_NOT_FOUND, FAILED_PRECONDITION /
                NOT_STEP_WISE, what `verify_checks.check_item` raises, or the `/step` failure
                (as for a `/verify`; `steps.read_step_reply`).
        """
        session = self._session(request.session_id)
        _kind(session, step_wise=True)
        item = checked_item(request.item, session.name)
        payload, _ = verify_checks.check_item(
            item, max_item_bytes=self._max_item_bytes, session_servers=()
        )
        with _busy(session):
            reply = await self._post(session, STEP_PATH, payload, item.timeout_seconds, deadline)
        result = upstream.read(reply, session.replica.url + STEP_PATH, read_step_reply)
        if result.terminated or result.truncated:
            self.close(request.session_id)
        return result, reply.seconds

    def close(self, session_id: str) -> bool:
        """Take the session out of the table and close it upstream (in the background);
        False when it was not open."""
        session = self._open.pop(session_id, None)
        if session is None:
            return False
        self._close_upstream(session)
        return True

    async def aclose(self) -> None:
        """Close every open session upstream and wait for those closes (on drain)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        for session_id in list(self._open):
            self.close(session_id)
        await self._closer.drain()

    def _session(self, session_id: str) -> Session:
        session = self._open.get(session_id)
        if session is None:
            raise errors.ItemError(
                code_pb2.NOT_FOUND,
                reasons.SESSION_NOT_FOUND,
                f"no open session {session_id[:100]!r}: never opened, closed, or idle past "
                "its lease",
                sessionId=session_id[:100],
            )
        return session

    async def _post(
        self, session: Session, path: str, body: bytes, timeout: float, deadline: float | None
    ) -> Reply:
        """One POST of `body` to `path` on the session's replica, in one of its slots, with
        the session's cookies; the cookies its reply sets replace theirs by name."""
        replica = session.replica
        url = replica.url + path
        try:
            async with replica.use(attempts.slot_wait(deadline)) as queued:
                reply = await upstream.post(
                    self._client,
                    replica,
                    url,
                    body,
                    request_id=session.opened.session_id,
                    item_timeout=timeout,
                    default_timeout=self._default_timeout,
                    deadline=deadline,
                    record=self.metrics.call,
                    labels=(session.name, path if path in ROUTES else "/(tool)"),
                    cookie=session.cookie,
                    queued=queued,
                )
        except SlotTimeout as exc:
            raise attempts.slot_timeout(url, exc.queued) from None
        if reply.set_cookies:
            fresh = sessions.cookie_header(reply.set_cookies, url)
            session.cookie = merged_cookies(session.cookie, fresh)
        return reply

    def _close_upstream(self, session: Session) -> None:
        if session.closes:
            url = session.replica.url + CLOSE_PATH
            opened = session.opened
            self._closer.later(url, opened, session.cookie, opened.session_id, session.name)

    def _closed(self, name: str, reason: str, seconds: float) -> None:
        self.metrics.call(name, CLOSE_PATH, seconds)
        self.metrics.close(name, reason)

    def _start_sweeping(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweep())

    async def _sweep(self) -> None:
        """Close the sessions idle past their lease, every SWEEP_EVERY seconds, until none is
        open."""
        while self._open:
            await asyncio.sleep(SWEEP_EVERY)
            now = time.monotonic()
            for session_id, session in list(self._open.items()):
                if not session.busy and now - session.idle_since > session.lease:
                    log.info("session %s idle past its lease of %g s: closed", session_id,
                             session.lease)  # fmt: skip
                    self.close(session_id)


class _busy:
    """A call in progress on `session` (its lease does not run out meanwhile)."""

    __slots__ = ("_session",)

    def __init__(self, session: Session) -> None:
        self._session = session

    def __enter__(self) -> None:
        self._session.busy += 1

    def __exit__(self, *exc_info: object) -> None:
        self._session.busy -= 1
        self._session.idle_since = time.monotonic()


def _kind(session: Session, *, step_wise: bool) -> None:
    """Raise FAILED_PRECONDITION / NOT_STEP_WISE unless `session` is step-wise exactly when
    the call (Step: True; VerifySession: False) needs it."""
    if session.step_wise != step_wise:
        kind = "step-wise (/reset, /step)" if session.step_wise else "not step-wise"
        use = "Step" if session.step_wise else "VerifySession"
        raise errors.ItemError(
            code_pb2.FAILED_PRECONDITION,
            reasons.NOT_STEP_WISE,
            f"session {session.opened.session_id!r} on {session.name} is {kind}: use {use}",
        )
