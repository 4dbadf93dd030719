"""One item -> NeMo Gym `POST /verify` on one of its server's replicas (after
`POST /seed_session` when the item runs as a session; retried when the cause is transient) ->
one `VerifyResponse`.

Every call ends in exactly one `VerifyResponse`: the reward, or a per-item `error`. The only
exception that escapes is `asyncio.CancelledError` (the RPC was cancelled); the in-flight HTTP
request is then closed and its upstream slot freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from http.cookies import Morsel

import aiohttp
import tenacity
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors, nemo_gym, sessions
from nemo_gym_grpc.bridge.balancer import Balancer, Replica
from nemo_gym_grpc.bridge.metrics import UNKNOWN_SERVER, Metrics
from nemo_gym_grpc.bridge.upstreams import Upstreams
from nemo_gym_grpc.v1 import verify_pb2

log = logging.getLogger(__name__)

# Seconds kept back from the gRPC deadline so the answer still reaches the client in time.
DEADLINE_MARGIN = 0.05
# Default cap on one item's serialized size (`VerifyRequest.ByteSize()`), bytes.
MAX_ITEM_BYTES = 16 * 1024 * 1024
# The VerifyRequest fields that carry JSON text.
JSON_FIELDS = ("row_json", "responses_create_params_json", "response_json")


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff and full jitter.

    Attributes:
        attempts: most attempts per item, first one included (1 = no retries).
        initial_backoff: seconds before the second attempt (before jitter).
        max_backoff: cap on one backoff, seconds.
        budget: most seconds from an item's first attempt to the start of its last one.
    """

    attempts: int = 3
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    budget: float = 60.0


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
            session (as if `seed_session` were set; `--session-server`).
        metrics: where outcomes, latencies and retries are counted (a fresh one by default).

    Attributes:
        balancer: the replicas called so far and their load.
    """

    def __init__(
        self,
        upstreams: Upstreams,
        session: aiohttp.ClientSession,
        default_timeout: float = 30.0,
        max_in_flight: int = 256,
        retry: RetryPolicy | None = None,
        max_item_bytes: int = MAX_ITEM_BYTES,
        session_servers: Iterable[str] = (),
        metrics: Metrics | None = None,
    ) -> None:
        self.upstreams = upstreams
        self._session = session
        self._default_timeout = default_timeout
        self._retry = retry or RetryPolicy()
        self._max_item_bytes = max_item_bytes
        self._session_servers = frozenset(session_servers)
        self.metrics = metrics or Metrics()
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
            A VerifyResponse with `request_id` set and either `reward` or `error`.
        """
        result = verify_pb2.VerifyResponse(request_id=request.request_id)
        try:
            await self._verify(request, deadline, result)
        except errors.ItemError as exc:
            return self.failed(request, exc, result.latency_seconds)
        except Exception as exc:  # a bug here must not cost the item its outcome
            log.exception("unexpected error scoring request_id=%r", request.request_id)
            error = errors.ItemError(
                code_pb2.INTERNAL, errors.BRIDGE_INTERNAL, f"bridge error: {exc!r}"
            )
            return self.failed(request, error, result.latency_seconds)
        self.metrics.item(request.resources_server, "OK", "")
        return result

    def failed(
        self, request: verify_pb2.VerifyRequest, error: errors.ItemError, latency: float = 0.0
    ) -> verify_pb2.VerifyResponse:
        """The failed result of `request` (request_id, `latency` seconds and `error` only),
        counted in the metrics."""
        label = request.resources_server
        if not self.upstreams.get(label):
            label = UNKNOWN_SERVER  # request text must not grow the label set
        self.metrics.item(label, code_pb2.Code.Name(error.code), error.reason)
        failed = verify_pb2.VerifyResponse(request_id=request.request_id, latency_seconds=latency)
        failed.error.CopyFrom(error.to_status())
        return failed

    async def _verify(
        self,
        request: verify_pb2.VerifyRequest,
        deadline: float | None,
        result: verify_pb2.VerifyResponse,
    ) -> None:
        name = request.resources_server
        payload, seed = self._payloads(request)
        urls = await self.upstreams.resolve(name)
        call = _Call(name, payload, seed, request.timeout_seconds or self._default_timeout)
        policy = self._retry
        bound = time.monotonic() + policy.budget
        if deadline is not None:
            bound = min(bound, deadline)
        tried: list[str] = []
        attempt_number = 1
        try:
            try:  # the first attempt runs without the retry machinery (the common case)
                replica = self.balancer.pick(urls, tried)
                tried.append(replica.url)
                raw = await self._attempt(replica, call, deadline, result)
            except errors.ItemError as first:
                if not first.retryable or policy.attempts < 2:
                    raise
                retrying = self._retrying(urls, tried, bound)
                replica, raw, attempt_number = await self._retry_after(
                    first, retrying, urls, tried, call, deadline, result
                )
            # Bad replies and reported failures are not retried: a retry would repeat
            # the same scoring (and, for judge failures, its judge calls).
            url = f"{replica.url}/verify"
            nemo_gym.read_verify_reply(raw, url, result, request.include_reply)
        except errors.ItemError as exc:
            exc.metadata.setdefault("attempts", str(attempt_number))
            raise

    def _retrying(self, urls: list[str], tried: list[str], bound: float) -> tenacity.AsyncRetrying:
        """The retry loop of one item: at most `policy.attempts` attempts, none starting after
        `bound` (monotonic seconds); no wait before a replica the item has not tried yet,
        else exponential backoff with full jitter; only `ItemError.retryable` causes are retried."""
        policy = self._retry
        backoff = tenacity.wait_random_exponential(
            multiplier=policy.initial_backoff, max=policy.max_backoff
        )

        def wait(state: tenacity.RetryCallState) -> float:
            return 0.0 if len(set(tried)) < len(urls) else backoff(state)

        def out_of_time(state: tenacity.RetryCallState) -> bool:
            return time.monotonic() + state.upcoming_sleep >= bound

        return tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(policy.attempts) | out_of_time,
            wait=wait,
            retry=tenacity.retry_if_exception(
                lambda exc: isinstance(exc, errors.ItemError) and exc.retryable
            ),
            reraise=True,
        )

    async def _retry_after(
        self,
        first: errors.ItemError,
        retrying: tenacity.AsyncRetrying,
        urls: list[str],
        tried: list[str],
        call: _Call,
        deadline: float | None,
        result: verify_pb2.VerifyResponse,
    ) -> tuple[Replica, bytes, int]:
        """Attempts 2.. after a retryable first failure: (replica, 200 body, attempts made).

        `retrying` sees the first failure as its own attempt 1 (replayed, not re-sent), so its
        stop and backoff rules count every attempt. Raises the last ItemError, with its
        attempt count in `metadata["attempts"]`.
        """
        pending: errors.ItemError | None = first
        last_reason = first.reason
        number = 1
        try:
            async for attempt in retrying:
                number = attempt.retry_state.attempt_number
                with attempt:
                    if pending is not None:
                        replay, pending = pending, None
                        raise replay
                    self.metrics.retry(call.name, last_reason)
                    replica = self.balancer.pick(urls, tried)
                    tried.append(replica.url)
                    try:
                        raw = await self._attempt(replica, call, deadline, result)
                    except errors.ItemError as exc:
                        last_reason = exc.reason
                        raise
        except errors.ItemError as exc:
            exc.metadata["attempts"] = str(number)
            raise
        return replica, raw, number

    def _payloads(self, request: verify_pb2.VerifyRequest) -> tuple[bytes, bytes | None]:
        """The item checked and turned into the UTF-8 `/verify` body and, when the item runs
        as a session, the `/seed_session` body (else None).

        Raises:
            errors.ItemError: INVALID_ARGUMENT for an item over `max_item_bytes`, without a
                `resources_server`, with a negative or non-finite `timeout_seconds`, with JSON
                text that is invalid, not an object, holds NaN/Infinity, nests too deep, or
                holds a lone surrogate (a `"\\ud800"` escape: UTF-8 cannot encode it, and a
                NeMo Gym server answers such a body with HTTP 500).
        """
        size = request.ByteSize()
        if size > self._max_item_bytes:
            raise errors.ItemError(
                code_pb2.INVALID_ARGUMENT,
                errors.ITEM_TOO_LARGE,
                f"item is {size} bytes; the bridge accepts items of at most "
                f"{self._max_item_bytes} bytes",
                itemBytes=size,
                maxItemBytes=self._max_item_bytes,
            )
        if not request.resources_server:
            raise errors.invalid_item("resources_server is empty", field="resources_server")
        if not (math.isfinite(request.timeout_seconds) and request.timeout_seconds >= 0):
            raise errors.invalid_item(
                f"timeout_seconds must be finite and >= 0, got {request.timeout_seconds!r}",
                field="timeout_seconds",
            )
        body = nemo_gym.build_verify_body(request)
        try:
            payload = json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except UnicodeEncodeError:
            found = (f for f in JSON_FIELDS if _has_lone_surrogate(getattr(request, f)))
            field = next(found, "item")
            raise errors.invalid_item(
                f'{field} holds a lone surrogate escape (e.g. "\\ud800"): not valid '
                "Unicode text, UTF-8 cannot encode it",
                field=field,
            ) from None
        except ValueError as exc:  # NaN / Infinity in the item's JSON
            raise errors.invalid_item(f"item JSON cannot be sent: {exc}") from None
        except RecursionError:
            raise errors.invalid_item("item JSON nests too deeply to be sent") from None
        if request.seed_session or request.resources_server in self._session_servers:
            return payload, sessions.seed_body(body)  # a part of what encoded above
        return payload, None

    async def _attempt(
        self,
        replica: Replica,
        call: _Call,
        deadline: float | None,
        result: verify_pb2.VerifyResponse,
    ) -> bytes:
        """One attempt on one replica, in one of its slots: `/seed_session` (for a session)
        then `/verify` with that reply's cookies. Returns the 200 `/verify` body.

        Raises:
            errors.ItemError: the `/verify` failure, or any `/seed_session` failure with
                reason UPSTREAM_SESSION_FAILED (same codes as for `/verify`).
        """
        async with replica.use() as queued:
            cookie = ""
            if call.seed is not None:
                url = f"{replica.url}{sessions.SEED_PATH}"
                try:
                    status, raw, cookies = await self._post(
                        replica, url, call, call.seed, "", deadline, queued, None
                    )
                except errors.ItemError as exc:
                    exc.reason = errors.UPSTREAM_SESSION_FAILED
                    raise
                if status != 200:
                    raise errors.http_status_error(status, url, raw, errors.UPSTREAM_SESSION_FAILED)
                cookie = sessions.cookie_header(cookies)
            url = f"{replica.url}/verify"
            status, raw, _ = await self._post(
                replica, url, call, call.payload, cookie, deadline, queued, result
            )
        if status != 200:
            raise errors.http_status_error(status, url, raw)
        return raw

    async def _post(
        self,
        replica: Replica,
        url: str,
        call: _Call,
        payload: bytes,
        cookie: str,
        deadline: float | None,
        queued: float,
        result: verify_pb2.VerifyResponse | None,
    ) -> tuple[int, bytes, Mapping[str, Morsel[str]]]:
        """One HTTP POST: (status, body, cookies the reply set), or ItemError for a timeout
        or a transport failure. Sets `result.latency_seconds` when `result` is given."""
        started = time.monotonic()
        timeout = call.timeout
        if deadline is not None and deadline - started - DEADLINE_MARGIN < timeout:
            timeout = deadline - started - DEADLINE_MARGIN
            if timeout <= 0:
                raise errors.ItemError(
                    code_pb2.DEADLINE_EXCEEDED,
                    errors.UPSTREAM_TIMEOUT,
                    f"the RPC deadline passed while waiting {queued:.3f} s for a free slot "
                    f"to {url}",
                    upstreamUrl=url,
                    queuedSeconds=f"{queued:.3f}",
                )
        headers = {"Content-Type": "application/json"}
        if cookie:
            headers["Cookie"] = cookie
        try:
            async with self._session.post(
                url,
                data=payload,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
                allow_redirects=False,  # only configured URLs are called
            ) as reply:
                return reply.status, await reply.read(), reply.cookies
        except (asyncio.TimeoutError, TimeoutError):
            raise errors.ItemError(
                code_pb2.DEADLINE_EXCEEDED,
                errors.UPSTREAM_TIMEOUT,
                f"{url} did not answer within {timeout:.3f} s",
                upstreamUrl=url,
                timeoutSeconds=f"{timeout:.3f}",
                queuedSeconds=f"{queued:.3f}",
            ) from None
        except aiohttp.ClientError as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):
                replica.refused()  # passed over while another replica is available
            raise errors.ItemError(
                code_pb2.UNAVAILABLE,
                errors.UPSTREAM_UNAVAILABLE,
                f"{url} unreachable: {type(exc).__name__}: {exc}",
                upstreamUrl=url,
            ) from None
        finally:
            elapsed = time.monotonic() - started
            self.metrics.call(call.name, url[len(replica.url) :], elapsed)
            if result is not None:
                result.latency_seconds = elapsed


@dataclass(frozen=True)
class _Call:
    """What every attempt of one item sends: the resources server name, the `/verify` body,
    the `/seed_session` body (None = no session) and the per-call timeout in seconds."""

    name: str
    payload: bytes
    seed: bytes | None
    timeout: float


def _has_lone_surrogate(text: str) -> bool:
    try:
        json.dumps(json.loads(text), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    except (ValueError, RecursionError):
        return False
    return False
