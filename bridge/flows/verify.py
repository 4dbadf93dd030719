"""The verify flow: one item -> NeMo Gym `POST /verify` on one of its server's replicas (after
`POST /seed_session` when the item runs as a session) -> one `VerifyResponse`.

The steps, top to bottom: check the item (`verify_checks.check_item`), resolve its resources
server (`Upstreams.resolve`), its attempts on the one upstream call path (`upstream`; a
transient failure is retried), each in one of its replica's slots, and read the reply
(`nemo_gym.verify.read_verify_reply`). Every call ends in exactly one `VerifyResponse`: the
reward, or a per-item `error`. The only exception that escapes is `asyncio.CancelledError` (the
RPC was cancelled); the in-flight HTTP request is then closed and its upstream slot freed.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows import attempts, upstream, verify_checks
from nemo_gym_grpc.bridge.flows.attempts import RetryPolicy
from nemo_gym_grpc.bridge.flows.balancer import Balancer, Replica, SlotTimeout
from nemo_gym_grpc.bridge.flows.upstreams import Upstreams
from nemo_gym_grpc.bridge.nemo_gym import capabilities, correlation, http, sessions
from nemo_gym_grpc.bridge.nemo_gym.http import Refused, Reply
from nemo_gym_grpc.bridge.nemo_gym.scores import Scored
from nemo_gym_grpc.bridge.nemo_gym.sessions import CLOSE_PATH, RESET_PATH, SEED_PATH
from nemo_gym_grpc.bridge.nemo_gym.verify import VERIFY_PATH, read_verify_reply
from nemo_gym_grpc.bridge.process.metrics import UNKNOWN_SERVER, Metrics
from nemo_gym_grpc.shared import reasons
from nemo_gym_grpc.v1 import verify_pb2

log = logging.getLogger(__name__)


class Verifier:
    """Scores `VerifyRequest`s against their resources servers over HTTP.

    Args:
        upstreams: the name -> base URLs routing table.
        client: the bridge's upstream HTTP client (`nemo_gym.http.Client`), owned by the
            caller.
        default_timeout: seconds for one upstream call when the item sets none.
        max_in_flight: most concurrent calls per upstream base URL (replica): the ceiling of
            its adaptive limit, or its slots when `adaptive_concurrency` is False. Further
            items wait for a slot; the wait does not count against their own timeout, only against
            the RPC deadline (and is reported as `queuedSeconds` when that cuts an item short).
        retry: the retry policy (`attempts.RetryPolicy`).
        max_item_bytes: largest item accepted, in serialized bytes (`VerifyRequest.ByteSize()`);
            a bigger one fails alone with INVALID_ARGUMENT / ITEM_TOO_LARGE.
        session_servers: resources server names whose items always run as their own NeMo Gym
            session (as if `seed_session` were set).
        metrics: where outcomes, latencies and retries are counted.
        rollout_correlation: send an item's calls under `/ng-rollout/<request_id>` to the
            replicas that take that prefix (NeMo Gym 0.7); False = plain routes only.
        adaptive_concurrency: each replica's slots follow its adaptive limit (`limits`);
            False = `max_in_flight` slots each (`--fixed-concurrency`).
        queue_share: the limiters in front of the same servers, this one included
            (`--sharing-bridges`, times the workers; `limits.Limit`'s `share`).

    Attributes:
        balancer: the replicas called so far and their load.
        capabilities: what each replica supports (learned on its first call).
    """

    def __init__(
        self,
        upstreams: Upstreams,
        client: http.Client,
        *,
        default_timeout: float,
        max_in_flight: int,
        retry: RetryPolicy,
        max_item_bytes: int,
        session_servers: Iterable[str],
        metrics: Metrics,
        rollout_correlation: bool = True,
        adaptive_concurrency: bool = True,
        queue_share: int = 1,
    ) -> None:
        self.upstreams = upstreams
        self._client = client
        self._default_timeout = default_timeout
        self._retry = retry
        self._max_item_bytes = max_item_bytes
        self._session_servers = frozenset(session_servers)
        self.metrics = metrics
        self.balancer = Balancer(max_in_flight, adaptive_concurrency, queue_share)
        self.capabilities = capabilities.Catalog(client.session)
        self._correlate = rollout_correlation
        self._closer = sessions.Closer(client, self._closed)
        self._unseeded_warned: set[str] = set()

    async def aclose(self) -> None:
        """Cancel the `/close_session` calls and capability learning still under way (on
        drain) and wait for them to end."""
        await self._closer.aclose()
        await self.capabilities.aclose()

    async def verify(
        self, request: verify_pb2.VerifyRequest, deadline: float | None
    ) -> verify_pb2.VerifyResponse:
        """Score one item.

        Args:
            request: the item.
            deadline: `time.monotonic()` value by which the answer is due (the RPC deadline),
                or None.

        Returns:
            A VerifyResponse with `request_id` set and either `reward` (with the reply's
            `failure_kind` / `failure_reason` when it named any) or `error`.
        """
        try:
            scored, seconds = await self._verify(request, deadline)
        except Exception as exc:  # every item gets its outcome, a bridge bug's included
            return self.failed(request, errors.as_item_error(exc, request.request_id))
        self.metrics.item(request.resources_server, "OK", "")
        return scored_response(request.request_id, scored, seconds)

    def failed(
        self, request: verify_pb2.VerifyRequest, error: errors.ItemError
    ) -> verify_pb2.VerifyResponse:
        """The failed result of `request` (request_id, `error.latency_seconds` and `error`
        only), counted in the metrics."""
        label = request.resources_server
        if not self.upstreams.get(label):
            label = UNKNOWN_SERVER  # request text must not grow the label set
        self.metrics.item(label, code_pb2.Code.Name(error.code), error.reason)
        return error.result(verify_pb2.VerifyResponse, request.request_id)

    async def _verify(
        self, request: verify_pb2.VerifyRequest, deadline: float | None
    ) -> tuple[Scored, float]:
        """(score, seconds of its `/verify` call), or ItemError."""
        payload, seed = verify_checks.check_item(
            request, max_item_bytes=self._max_item_bytes, session_servers=self._session_servers
        )
        name = request.resources_server
        urls = await self.upstreams.resolve(name)
        call = _Call(
            name, request.request_id, payload, seed, request.timeout_seconds, request.include_reply
        )
        tries = attempts.Attempts(self._retry, deadline, self.balancer, urls)
        while True:
            replica = tries.next()
            try:
                return await self._attempt(replica, tries.number, call, deadline)
            except errors.ItemError as exc:
                if isinstance(exc, Refused):
                    tries.reroute(await self.upstreams.moved(name, tries.urls))
                await tries.again(exc)  # raises it when it is final
                self.metrics.retry(name, exc.reason)

    async def _attempt(
        self, replica: Replica, attempt: int, call: _Call, deadline: float | None
    ) -> tuple[Scored, float]:
        """Attempt number `attempt` (1 = the first) on one replica, in one of its slots:
        `/seed_session` (for a session; typed where the replica takes only that) then
        `/verify` with that reply's cookies, each under the rollout prefix where the replica
        takes it; then its reply read. A session opened is closed in the background
        (`sessions.Closer`). On a step-wise replica (`capabilities.step_wise`) the item is a
        one-step episode instead: `/reset` with the row, then `/step` with the `/verify` body
        in that session; the step's reward is the item's (the server ends its session when the
        step terminates it; it has no `/close_session`).

        Raises:
            errors.ItemError: the `/verify` failure, or any `/seed_session` failure with
                reason UPSTREAM_SESSION_FAILED (same codes as for `/verify`). Not retryable
                when the replica's `/reverify_mode` is "unsupported" and the `/verify`
                request may have reached it.
        """
        caps = await self._learned(replica, deadline)
        base = replica.url  # + the rollout prefix: where this attempt's routes are
        if self._correlate and caps.correlation:
            base += correlation.rollout_prefix(call.request_id, attempt)
        if call.seed is None and caps.custom_seed:
            self._unseeded(call.name, replica.url)
        route = sessions.STEP_PATH if caps.step_wise else VERIFY_PATH
        url = base + route
        try:
            async with replica.use(attempts.slot_wait(deadline)) as queued:
                cookie = ""
                opened: sessions.Opened | None = None
                if caps.step_wise:
                    reset = sessions.reset_body(call.payload)
                    cookie = await self._open(
                        replica, base, RESET_PATH, call, reset, deadline, queued
                    )
                elif call.seed is not None:
                    opened = sessions.open_session(call.request_id, attempt)
                    cookie = await self._seed(replica, base, call, caps, opened, deadline, queued)
                try:
                    reply = await self._post(
                        replica, base, route, call, call.payload, cookie, deadline, queued
                    )
                except errors.ItemError as exc:
                    _no_reverify(exc, caps, sent=not isinstance(exc, (Refused, attempts.NotSent)))
                    raise
                finally:
                    if opened is not None and caps.close_session:
                        self._close(base, opened, cookie, call)
        except SlotTimeout as exc:
            raise attempts.slot_timeout(url, exc.queued) from None
        try:
            scored = upstream.read(reply, url, read_verify_reply, call.include_reply)
        except errors.ItemError as exc:
            _no_reverify(exc, caps, sent=True)
            raise
        return scored, reply.seconds

    async def _learned(self, replica: Replica, deadline: float | None) -> capabilities.Capabilities:
        """What `replica` supports, waiting for it at most `capabilities.LEARN_TIMEOUT` and
        what the RPC `deadline` leaves (`attempts.time_left`).

        Raises:
            attempts.NotSent: the RPC deadline (less its margin) passed while waiting.
        """
        wait = attempts.wait_within(capabilities.LEARN_TIMEOUT, deadline)
        caps = await self.capabilities.of(replica.url, wait)
        if deadline is not None and attempts.time_left(deadline) <= 0:
            raise attempts.deadline_passed(
                f"while learning what {replica.url} supports (GET /openapi.json; an item "
                f"waits for it at most {capabilities.LEARN_TIMEOUT:g} s)",
                upstreamUrl=replica.url,
            )
        return caps

    async def _seed(
        self,
        replica: Replica,
        base: str,
        call: _Call,
        caps: capabilities.Capabilities,
        opened: sessions.Opened,
        deadline: float | None,
        queued: float,
    ) -> str:
        """`/seed_session` at `base` (the replica's URL and the attempt's rollout prefix) for
        session `opened`; returns the `Cookie` header its reply sets. A typed seed that may
        have reached the server is closed even when it failed.

        Raises:
            errors.ItemError: with reason UPSTREAM_SESSION_FAILED.
        """
        assert call.seed is not None
        body = call.seed
        if caps.typed_seed_only:
            body = sessions.typed_seed_body(opened, call.name, opened.rollout_id, call.seed)
        try:
            return await self._open(replica, base, SEED_PATH, call, body, deadline, queued)
        except errors.ItemError as exc:
            sent = not isinstance(exc, (Refused, attempts.NotSent))
            if sent and caps.typed_seed_only and caps.close_session:
                self._close(base, opened, "", call)
            raise

    async def _open(
        self,
        replica: Replica,
        base: str,
        path: str,
        call: _Call,
        body: bytes,
        deadline: float | None,
        queued: float,
    ) -> str:
        """POST `body` to the session-opening `path` (`/seed_session`, `/reset`) at `base`;
        returns the `Cookie` header its reply sets.

        Raises:
            errors.ItemError: with reason UPSTREAM_SESSION_FAILED.
        """
        try:
            opened = await self._post(replica, base, path, call, body, "", deadline, queued)
            if opened.status != 200:
                error = errors.http_status_error(
                    opened.status, base + path, opened.body, reasons.UPSTREAM_SESSION_FAILED
                )
                upstream.note_redirect(error, opened)
                try:
                    raise error
                finally:
                    del error  # errors.py: no reference cycle through this frame
            return sessions.cookie_header(opened.set_cookies, base + path)
        except errors.ItemError as exc:
            exc.reason = reasons.UPSTREAM_SESSION_FAILED
            raise

    def _close(self, base: str, opened: sessions.Opened, cookie: str, call: _Call) -> None:
        """`/close_session` of `opened` at `base`, in the background."""
        self._closer.later(base + CLOSE_PATH, opened, cookie, call.request_id, call.name)

    def _closed(self, name: str, reason: str, seconds: float) -> None:
        """Count one `/close_session` call (reason "" = closed)."""
        self.metrics.call(name, CLOSE_PATH, seconds)
        self.metrics.close(name, reason)

    def _unseeded(self, name: str, url: str) -> None:
        """Count an item run without a session on a server whose `/seed_session` takes a body
        of its own; warn once per server name."""
        self.metrics.unseeded_item(name)
        if name not in self._unseeded_warned:
            self._unseeded_warned.add(name)
            log.warning(
                "%s (%s) keeps per-session state (its /seed_session takes its own body) but an "
                "item of it runs without a session, which such a server usually scores 0.0: "
                "pass --session-server %s or set seed_session on its items",
                name,
                url,
                name,
            )

    def _post(
        self,
        replica: Replica,
        base: str,
        path: str,
        call: _Call,
        body: bytes,
        cookie: str,
        deadline: float | None,
        queued: float,
    ) -> Coroutine[Any, Any, Reply]:
        """One POST of `body` to `base + path` on `replica` (`upstream.post`, returned to be
        awaited), counted in the latency metric under `path`."""
        return upstream.post(
            self._client,
            replica,
            base + path,
            body,
            request_id=call.request_id,
            item_timeout=call.timeout,
            default_timeout=self._default_timeout,
            deadline=deadline,
            record=self.metrics.call,
            labels=(call.name, path),
            cookie=cookie,
            queued=queued,
        )


def scored_response(request_id: str, scored: Scored, seconds: float) -> verify_pb2.VerifyResponse:
    """The VerifyResponse of a scored item: its reward, components, reply fields and the
    reply's `failure_kind` / `failure_reason` when it named any; `seconds` its latency."""
    result = verify_pb2.VerifyResponse(
        request_id=request_id, reward=scored.reward, latency_seconds=seconds
    )
    if scored.components:  # (faster than passing them to the constructor)
        result.reward_components.update(scored.components)
    if scored.reply_json:
        result.reply_json = scored.reply_json
    if scored.failure_kind:  # a valid but degraded measurement (NeMo Gym >= 0.7)
        result.failure_kind = scored.failure_kind
    if scored.failure_reason:
        result.failure_reason = scored.failure_reason
    return result


def _no_reverify(exc: errors.ItemError, caps: capabilities.Capabilities, sent: bool) -> None:
    """Make a `/verify` failure final when the replica says re-running its `/verify` is not
    safe (`/reverify_mode` "unsupported") and the request may have reached it (`sent`)."""
    if sent and exc.retryable and caps.reverify_mode == "unsupported":
        exc.retryable = False
        exc.metadata["reverifyMode"] = caps.reverify_mode


@dataclass(slots=True)  # not frozen: one per item, and a frozen __init__ costs ~4 us more
class _Call:
    """What every attempt of one item sends: the resources server name, the item's
    request_id, the `/verify` body, the `/seed_session` body (None = no session), the item's
    own per-call timeout in seconds (0 = the default), and whether its reply's other fields
    are wanted. Never changed once made."""

    name: str
    request_id: str
    payload: bytes
    seed: bytes | None
    timeout: float
    include_reply: bool
