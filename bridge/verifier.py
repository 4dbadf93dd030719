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
from nemo_gym_grpc.bridge.balancer import Balancer, Replica
from nemo_gym_grpc.bridge.metrics import UNKNOWN_SERVER, Metrics
from nemo_gym_grpc.bridge.upstreams import Upstreams
from nemo_gym_grpc.v1 import verify_pb2

log = logging.getLogger(__name__)

# Seconds kept back from the gRPC deadline so the answer still reaches the client in time.
DEADLINE_MARGIN = 0.05


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

    Attributes:
        balancer: the replicas called so far and their load.
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
    ) -> None:
        self.upstreams = upstreams
        self._session = session
        self._default_timeout = default_timeout
        self._retry = retry
        self._max_item_bytes = max_item_bytes
        self._session_servers = frozenset(session_servers)
        self.metrics = metrics
        self.balancer = Balancer(max_in_flight)

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
        call = _Call(name, nemo_gym.request_id_header(request.request_id), payload, seed, timeout)
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
                return await self._attempt(replica, call, deadline, request.include_reply)
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
        self, replica: Replica, call: _Call, deadline: float | None, include_reply: bool
    ) -> tuple[nemo_gym.Scored, float]:
        """One attempt on one replica, in one of its slots: `/seed_session` (for a session)
        then `/verify` with that reply's cookies; then its reply read.

        Raises:
            errors.ItemError: the `/verify` failure, or any `/seed_session` failure with
                reason UPSTREAM_SESSION_FAILED (same codes as for `/verify`).
        """
        async with replica.use() as queued:
            cookie = ""
            if call.seed is not None:
                try:
                    seeded = await self._post(
                        replica, nemo_gym.SEED_PATH, call, call.seed, "", deadline, queued
                    )
                except errors.ItemError as exc:
                    exc.reason = errors.UPSTREAM_SESSION_FAILED
                    raise
                if seeded.status != 200:
                    raise errors.http_status_error(
                        seeded.status,
                        replica.url + nemo_gym.SEED_PATH,
                        seeded.body,
                        errors.UPSTREAM_SESSION_FAILED,
                    )
                cookie = nemo_gym.cookie_header(seeded.cookies)
            reply = await self._post(
                replica, nemo_gym.VERIFY_PATH, call, call.payload, cookie, deadline, queued
            )
        url = replica.url + nemo_gym.VERIFY_PATH
        try:
            if reply.status != 200:
                raise errors.http_status_error(reply.status, url, reply.body)
            return nemo_gym.read_verify_reply(reply.body, url, include_reply), reply.seconds
        except errors.ItemError as exc:
            exc.latency_seconds = reply.seconds
            raise

    async def _post(
        self,
        replica: Replica,
        path: str,
        call: _Call,
        body: bytes,
        cookie: str,
        deadline: float | None,
        queued: float,
    ) -> nemo_gym.Reply:
        """One POST of `body` to `path` on `replica`, with the item's timeout cut to what the
        RPC deadline leaves; counted in the latency metric. Raises ItemError."""
        url = replica.url + path
        timeout = call.timeout
        if deadline is not None:
            left = deadline - time.monotonic() - DEADLINE_MARGIN
            if left < timeout:
                timeout = left
                if timeout <= 0:
                    raise errors.ItemError(
                        code_pb2.DEADLINE_EXCEEDED,
                        errors.UPSTREAM_TIMEOUT,
                        f"the RPC deadline passed while waiting {queued:.3f} s for a free slot "
                        f"to {url}",
                        upstreamUrl=url,
                        queuedSeconds=f"{queued:.3f}",
                    )
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


@dataclass(frozen=True, slots=True)
class _Call:
    """What every attempt of one item sends: the resources server name, the `X-Request-Id`
    header value, the `/verify` body, the `/seed_session` body (None = no session) and the
    per-call timeout in seconds."""

    name: str
    request_id: str
    payload: bytes
    seed: bytes | None
    timeout: float
