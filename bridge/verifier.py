"""One item -> NeMo Gym `POST /verify` on one of its server's replicas (after
`POST /seed_session` when the item runs as a session; retried when the cause is transient) ->
one `VerifyResponse`.

The steps, top to bottom: check the item (`validation.check_item`), resolve its resources
server (`Upstreams.resolve`), the attempt loop (`RetryPolicy`), read the reply
(`nemo_gym.read_verify_reply`). Every call ends in exactly one `VerifyResponse`: the reward,
or a per-item `error`. The only exception that escapes is `asyncio.CancelledError` (the RPC
was cancelled); the in-flight HTTP request is then closed and its upstream slot freed.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors, nemo_gym, validation
from nemo_gym_grpc.bridge.balancer import Balancer, Replica, SlotTimeout
from nemo_gym_grpc.bridge.metrics import UNKNOWN_SERVER, Metrics
from nemo_gym_grpc.bridge.upstreams import Upstreams
from nemo_gym_grpc.v1 import verify_pb2

log = logging.getLogger(__name__)

# Kept back from the gRPC deadline so an item's answer still reaches the client in time: at
# least DEADLINE_MARGIN seconds, or DEADLINE_MARGIN_SHARE of the time left when that is more
# (on a busy machine, thousands of results cut at the deadline take more than 50 ms to send,
# and the whole call then ends DEADLINE_EXCEEDED before they get their own UPSTREAM_TIMEOUT).
# The one home of this rule is `time_left`; the runner (RunStream) uses it too.
DEADLINE_MARGIN = 0.05
DEADLINE_MARGIN_SHARE = 0.02


def time_left(deadline: float, now: float | None = None) -> float:
    """Seconds an upstream call started at `now` (default: `time.monotonic()`) may take so
    that its answer still beats the RPC `deadline` (`time.monotonic()` seconds): the time left
    less max(DEADLINE_MARGIN, DEADLINE_MARGIN_SHARE x the time left). <= 0: no time."""
    left = deadline - (time.monotonic() if now is None else now)
    return left - max(DEADLINE_MARGIN, DEADLINE_MARGIN_SHARE * left)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff and full jitter.

    Attributes:
        attempts: most attempts per item, first one included (1 = no retries).
        budget: most seconds from an item's first attempt to the start of its last one.
        initial_backoff: seconds before the second attempt (before jitter).
        max_backoff: cap on one backoff, seconds.
    """

    attempts: int
    budget: float
    initial_backoff: float = 0.1
    max_backoff: float = 2.0

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1 = the first) on a replica
        already tried: uniform in [0, min(max_backoff, initial_backoff * 2**(attempt-1))]."""
        return random.uniform(0.0, min(self.max_backoff, self.initial_backoff * 2 ** (attempt - 1)))


class Verifier:
    """Scores `VerifyRequest`s against their resources servers over HTTP.

    Args:
        upstreams: the name -> base URLs routing table.
        session: an aiohttp session (keep-alive pool) owned by the caller. It must keep no
            cookies (`aiohttp.DummyCookieJar()`): NeMo Gym sets a session cookie on every
            reply, and a shared jar would send one item's session with another's `/verify`.
        default_timeout: seconds for one upstream call when the item sets none.
        max_in_flight: most concurrent calls per upstream base URL (replica). Further items
            wait for a slot; the wait does not count against their own timeout, only against
            the RPC deadline (and is reported as `queuedSeconds` when that cuts an item short).
        retry: the retry policy.
        max_item_bytes: largest item accepted, in serialized bytes (`VerifyRequest.ByteSize()`);
            a bigger one fails alone with INVALID_ARGUMENT / ITEM_TOO_LARGE.
        session_servers: resources server names whose items always run as their own NeMo Gym
            session (as if `seed_session` were set).
        metrics: where outcomes, latencies and retries are counted.
        rollout_correlation: send an item's calls under `/ng-rollout/<request_id>` to the
            replicas that take that prefix (NeMo Gym 0.7); False = plain routes only.

    Attributes:
        balancer: the replicas called so far and their load.
        capabilities: what each replica supports (learned on its first call).
    """

    def __init__(
        self,
        upstreams: Upstreams,
        session: aiohttp.ClientSession,
        *,
        default_timeout: float,
        max_in_flight: int,
        retry: RetryPolicy,
        max_item_bytes: int,
        session_servers: Iterable[str],
        metrics: Metrics,
        rollout_correlation: bool = True,
    ) -> None:
        self.upstreams = upstreams
        self._session = session
        self._default_timeout = default_timeout
        self._retry = retry
        self._max_item_bytes = max_item_bytes
        self._session_servers = frozenset(session_servers)
        self.metrics = metrics
        self.balancer = Balancer(max_in_flight)
        self.capabilities = nemo_gym.Catalog(session)
        self._correlate = rollout_correlation
        self._closer = nemo_gym.Closer(session, self._closed)
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
        except errors.ItemError as exc:
            return self.failed(request, exc)
        except Exception as exc:  # a bug here must not cost the item its outcome
            log.exception("unexpected error scoring request_id=%r", request.request_id)
            error = errors.ItemError(
                code_pb2.INTERNAL, errors.BRIDGE_INTERNAL, f"bridge error: {exc!r}"
            )
            return self.failed(request, error)
        self.metrics.item(request.resources_server, "OK", "")
        result = verify_pb2.VerifyResponse(
            request_id=request.request_id, reward=scored.reward, latency_seconds=seconds
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

    def failed(
        self, request: verify_pb2.VerifyRequest, error: errors.ItemError
    ) -> verify_pb2.VerifyResponse:
        """The failed result of `request` (request_id, `error.latency_seconds` and `error`
        only), counted in the metrics."""
        label = request.resources_server
        if not self.upstreams.get(label):
            label = UNKNOWN_SERVER  # request text must not grow the label set
        self.metrics.item(label, code_pb2.Code.Name(error.code), error.reason)
        failed = verify_pb2.VerifyResponse(
            request_id=request.request_id, latency_seconds=error.latency_seconds
        )
        failed.error.CopyFrom(error.to_status())
        return failed

    async def _verify(
        self, request: verify_pb2.VerifyRequest, deadline: float | None
    ) -> tuple[nemo_gym.Scored, float]:
        """(score, seconds of its `/verify` call), or ItemError."""
        payload, seed = validation.check_item(
            request, max_item_bytes=self._max_item_bytes, session_servers=self._session_servers
        )
        name = request.resources_server
        urls = await self.upstreams.resolve(name)
        timeout = request.timeout_seconds or self._default_timeout
        header = nemo_gym.request_id_header(request.request_id)
        rollout = request.request_id if nemo_gym.rollout_prefix(request.request_id, 1) else ""
        call = _Call(name, header, payload, seed, timeout, rollout)
        policy = self._retry
        bound = time.monotonic() + policy.budget
        if deadline is not None:
            bound = min(bound, deadline)
        tried: list[str] = []
        attempt = 1
        while True:
            # A replica the item has not tried yet gets the next attempt at once; else the
            # attempt waits its backoff. No attempt starts after `bound`.
            replica = self.balancer.pick(urls, tried)
            tried.append(replica.url)
            try:
                return await self._attempt(replica, call, attempt, deadline, request.include_reply)
            except errors.ItemError as exc:
                exc.metadata["attempts"] = str(attempt)
                if not exc.retryable or attempt >= policy.attempts:
                    raise
                delay = 0.0 if len(set(tried)) < len(urls) else policy.backoff(attempt)
                if time.monotonic() + delay >= bound:
                    raise
                reason = exc.reason
            if delay:
                await asyncio.sleep(delay)
            self.metrics.retry(name, reason)
            attempt += 1

    async def _attempt(
        self,
        replica: Replica,
        call: _Call,
        attempt: int,
        deadline: float | None,
        include_reply: bool,
    ) -> tuple[nemo_gym.Scored, float]:
        """Attempt number `attempt` (1 = the first) on one replica, in one of its slots:
        `/seed_session` (for a session; typed where the replica takes only that) then
        `/verify` with that reply's cookies, each under the rollout prefix where the replica
        takes it; then its reply read. A session opened is closed in the background
        (`nemo_gym.Closer`).

        Raises:
            errors.ItemError: the `/verify` failure, or any `/seed_session` failure with
                reason UPSTREAM_SESSION_FAILED (same codes as for `/verify`). Not retryable
                when the replica's `/reverify_mode` is "unsupported" and the `/verify`
                request may have reached it.
        """
        wait = nemo_gym.capabilities.LEARN_TIMEOUT
        if deadline is not None:
            wait = min(wait, time_left(deadline))
        caps = await self.capabilities.of(replica.url, wait)
        prefix = ""
        if self._correlate and caps.correlation and call.rollout_id:
            prefix = nemo_gym.rollout_prefix(call.rollout_id, attempt)
        if call.seed is None and caps.custom_seed:
            self._unseeded(call.name, replica.url)
        url = replica.url + prefix + nemo_gym.VERIFY_PATH
        try:
            async with replica.use(None if deadline is None else time_left(deadline)) as queued:
                cookie = ""
                opened: nemo_gym.Opened | None = None
                if call.seed is not None:
                    opened = nemo_gym.open_session(call.rollout_id, attempt)
                    cookie = await self._seed(replica, call, caps, opened, prefix, deadline, queued)
                try:
                    path, body = nemo_gym.VERIFY_PATH, call.payload
                    reply = await self._post(
                        replica, path, call, body, cookie, deadline, queued, prefix
                    )
                except errors.ItemError as exc:
                    sent = not isinstance(exc, (nemo_gym.Refused, _NotSent))
                    _no_reverify(exc, caps, sent)
                    raise
                finally:
                    if opened is not None and caps.close_session:
                        close = replica.url + prefix + nemo_gym.CLOSE_PATH
                        self._closer.later(close, opened, cookie, call.request_id, call.name)
        except SlotTimeout as exc:
            raise _slot_timeout(url, exc.queued) from None
        try:
            if reply.status != 200:
                raise errors.http_status_error(reply.status, url, reply.body)
            return nemo_gym.read_verify_reply(reply.body, url, include_reply), reply.seconds
        except errors.ItemError as exc:
            exc.latency_seconds = reply.seconds
            _no_reverify(exc, caps, sent=True)
            raise

    async def _seed(
        self,
        replica: Replica,
        call: _Call,
        caps: nemo_gym.Capabilities,
        opened: nemo_gym.Opened,
        prefix: str,
        deadline: float | None,
        queued: float,
    ) -> str:
        """`/seed_session` for session `opened`; returns the `Cookie` header its reply sets.
        A typed seed that may have reached the server is closed even when it failed.

        Raises:
            errors.ItemError: with reason UPSTREAM_SESSION_FAILED.
        """
        assert call.seed is not None
        body = call.seed
        if caps.typed_seed_only:
            body = nemo_gym.typed_seed_body(opened, call.name, call.rollout_id, call.seed)
        try:
            seeded = await self._post(
                replica, nemo_gym.SEED_PATH, call, body, "", deadline, queued, prefix
            )
            if seeded.status != 200:
                raise errors.http_status_error(
                    seeded.status,
                    replica.url + prefix + nemo_gym.SEED_PATH,
                    seeded.body,
                    errors.UPSTREAM_SESSION_FAILED,
                )
        except errors.ItemError as exc:
            exc.reason = errors.UPSTREAM_SESSION_FAILED
            sent = not isinstance(exc, (nemo_gym.Refused, _NotSent))
            if sent and caps.typed_seed_only and caps.close_session:
                close = replica.url + prefix + nemo_gym.CLOSE_PATH
                self._closer.later(close, opened, "", call.request_id, call.name)
            raise
        return nemo_gym.cookie_header(seeded.cookies)

    def _closed(self, name: str, reason: str, seconds: float) -> None:
        """Count one `/close_session` call (reason "" = closed)."""
        self.metrics.call(name, nemo_gym.CLOSE_PATH, seconds)
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

    async def _post(
        self,
        replica: Replica,
        path: str,
        call: _Call,
        body: bytes,
        cookie: str,
        deadline: float | None,
        queued: float,
        prefix: str = "",
    ) -> nemo_gym.Reply:
        """One POST of `body` to `prefix + path` on `replica`, with the item's timeout cut to
        what the RPC deadline leaves; counted in the latency metric under `path`. Raises
        ItemError (`_NotSent` when the deadline passed before sending)."""
        url = replica.url + prefix + path
        timeout = call.timeout
        if deadline is not None:
            left = time_left(deadline)
            if left < timeout:
                timeout = left
                if timeout <= 0:
                    raise _slot_timeout(url, queued)
        started = time.monotonic()
        try:
            reply = await nemo_gym.post(
                self._session,
                url,
                body,
                timeout=timeout,
                request_id=call.request_id,
                cookie=cookie,
                queued=queued,
            )
        except errors.ItemError as exc:
            if isinstance(exc, nemo_gym.Refused):
                replica.refused()  # passed over while another replica is available
            self.metrics.call(call.name, path, exc.latency_seconds)
            raise
        except asyncio.CancelledError:  # the RPC was cancelled: the call still took this long
            self.metrics.call(call.name, path, time.monotonic() - started)
            raise
        self.metrics.call(call.name, path, reply.seconds)
        return reply


class _NotSent(errors.ItemError):
    """The call was never sent (the RPC deadline passed before it could start)."""


def _slot_timeout(url: str, queued: float) -> _NotSent:
    """DEADLINE_EXCEEDED / UPSTREAM_TIMEOUT: the RPC deadline (less its margin) passed after
    `queued` seconds waiting for a free upstream slot, before anything was sent to `url`."""
    return _NotSent(
        code_pb2.DEADLINE_EXCEEDED,
        errors.UPSTREAM_TIMEOUT,
        f"the RPC deadline passed while waiting {queued:.3f} s for a free slot to {url}",
        upstreamUrl=url,
        queuedSeconds=f"{queued:.3f}",
    )


def _no_reverify(exc: errors.ItemError, caps: nemo_gym.Capabilities, sent: bool) -> None:
    """Make a `/verify` failure final when the replica says re-running its `/verify` is not
    safe (`/reverify_mode` "unsupported") and the request may have reached it (`sent`)."""
    if sent and exc.retryable and caps.reverify_mode == "unsupported":
        exc.retryable = False
        exc.metadata["reverifyMode"] = caps.reverify_mode


@dataclass(slots=True)  # not frozen: one per item, and a frozen __init__ costs ~4 us more
class _Call:
    """What every attempt of one item sends: the resources server name, the `X-Request-Id`
    header value, the `/verify` body, the `/seed_session` body (None = no session), the
    per-call timeout in seconds, and the item's request_id when it is a valid NeMo Gym rollout
    id (else ""). Never changed once made."""

    name: str
    request_id: str
    payload: bytes
    seed: bytes | None
    timeout: float
    rollout_id: str = ""
