"""The run flow: one rollout (`RunRequest`) -> NeMo Gym `POST /run` on one replica of its agent
server or environment server -> one `RunResponse`.

The steps, top to bottom: check the rollout (`run_checks.check_run`), resolve its agent
(`Upstreams.resolve` on the AGENTS table, which also gives the protocol), build the body
(`run_checks.check_body`), wait for one of the agent's `--agent-concurrency` slots
(bounded by the RPC deadline, `attempts.slot_wait`), its attempts on the one upstream call
path (`upstream`), read the reply (`nemo_gym.run.read_rollout` or
`nemo_gym.episodes.read_episode_reply`).

Retries happen only where the rollout cannot have started: the connection was refused (the
request was never sent), or an environment server refused the episode at admission. A
timeout, a 5xx after sending and everything else are final: a rollout runs a policy model and
tools, and running it twice is not the same as once. The number of attempts and their backoff
are `attempts.RetryPolicy`'s (`--retry-attempts`, `--retry-budget`).

Every call ends in exactly one `RunResponse`: the rollout, or a per-rollout `error`. The only
exception that escapes is `asyncio.CancelledError` (the RPC was cancelled or the bridge shuts
down); the agent's HTTP request is then closed (`nemo_gym.http.post` closes the connection of a
cancelled request: NeMo Gym 0.7 cancels the rollout's handler) and the agent's slot freed.
"""

from __future__ import annotations

import itertools
import logging
import time

from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows import attempts, run_checks, upstream
from nemo_gym_grpc.bridge.flows.attempts import RetryPolicy
from nemo_gym_grpc.bridge.flows.balancer import Balancer, Replica, Slots, SlotTimeout
from nemo_gym_grpc.bridge.flows.run_checks import Checked
from nemo_gym_grpc.bridge.flows.upstreams import Upstreams
from nemo_gym_grpc.bridge.nemo_gym import episodes, http
from nemo_gym_grpc.bridge.nemo_gym.head import ENVIRONMENT
from nemo_gym_grpc.bridge.nemo_gym.http import Refused
from nemo_gym_grpc.bridge.nemo_gym.run import RUN_PATH, Ran, read_rollout
from nemo_gym_grpc.bridge.nemo_gym.scores import parse_reply
from nemo_gym_grpc.bridge.process.metrics import UNKNOWN_SERVER, Metrics
from nemo_gym_grpc.shared import reasons
from nemo_gym_grpc.shared.stragglers import Stragglers
from nemo_gym_grpc.v1 import rollout_pb2

log = logging.getLogger(__name__)


class Runner:
    """Runs `RunRequest`s against agent servers and environment servers over HTTP.

    Args:
        agents: the AGENTS routing table (name -> base URLs and protocol).
        client: the bridge's upstream HTTP client (`nemo_gym.http.Client`).
        default_timeout: seconds of one `/run` call when the rollout sets none
            (`--run-timeout`).
        concurrency: most rollouts in flight per agent name, all replicas together
            (`--agent-concurrency`); further rollouts wait, bounded by their RPC deadline
            (without one, until a slot is free).
        retry: attempts and budget for the retries that are allowed (see the module;
            `attempts.RetryPolicy`).
        max_item_bytes: largest rollout accepted, serialized bytes.
        metrics: where outcomes and latencies are counted.

    Attributes:
        balancer: the replicas called so far and their load (least in-flight first).
        stragglers: the durations of finished rollouts per agent, for `check_stragglers`.
    """

    def __init__(
        self,
        agents: Upstreams,
        client: http.Client,
        *,
        default_timeout: float,
        concurrency: int,
        retry: RetryPolicy,
        max_item_bytes: int,
        metrics: Metrics,
    ) -> None:
        self.agents = agents
        self._client = client
        self._default_timeout = default_timeout
        self._concurrency = concurrency
        self._retry = retry
        self._max_item_bytes = max_item_bytes
        self.metrics = metrics
        # The per-name bound is the binding one; replicas get as many slots, never fewer.
        self.balancer = Balancer(concurrency)
        self._slots: dict[str, Slots] = {}
        # The rollouts holding a slot: (agent, request_id for logs, monotonic start).
        self._running: dict[int, tuple[str, str, float]] = {}
        self._tokens = itertools.count()
        self.stragglers = Stragglers(log, "RunStream")
        self._straggling: dict[str, int] = {}

    def load(self) -> dict[str, tuple[int, int, int]]:
        """{agent name: (rollouts in flight, waiting for a slot, straggling as of the last
        `check_stragglers`)} (for metrics)."""
        straggling = self._straggling
        return {n: (s.in_flight, s.waiting, straggling.get(n, 0)) for n, s in self._slots.items()}

    def check_stragglers(self) -> None:
        """Count (and log, rate-limited) the rollouts running far longer than their agent's
        others (`shared.stragglers`); nothing is cut for it."""
        self._straggling = self.stragglers.check(self._running.values())

    async def run(
        self, request: rollout_pb2.RunRequest, deadline: float | None
    ) -> rollout_pb2.RunResponse:
        """Run one rollout.

        Args:
            request: the rollout.
            deadline: `time.monotonic()` value by which the answer is due (the RPC deadline),
                or None.

        Returns:
            A RunResponse with `request_id` set and either `rollout` or `error`.
        """
        try:
            ran, seconds = await self._run(request, deadline)
        except Exception as exc:  # every rollout gets its outcome, a bridge bug's included
            return self.failed(request, errors.as_item_error(exc, request.request_id))
        self.stragglers.finished(request.agent, seconds)
        self.metrics.rollout(request.agent, "OK", "")
        return _response(request.request_id, ran, seconds)

    def failed(
        self, request: rollout_pb2.RunRequest, error: errors.ItemError
    ) -> rollout_pb2.RunResponse:
        """The failed result of `request` (request_id, `error.latency_seconds` and `error`
        only), counted in the metrics."""
        label = request.agent if self.agents.get(request.agent) else UNKNOWN_SERVER
        self.metrics.rollout(label, code_pb2.Code.Name(error.code), error.reason)
        return error.result(rollout_pb2.RunResponse, request.request_id)

    async def _run(
        self, request: rollout_pb2.RunRequest, deadline: float | None
    ) -> tuple[Ran, float]:
        """(the rollout, seconds of its `/run` call), or ItemError."""
        run_checks.check_run(request, max_item_bytes=self._max_item_bytes)
        name = request.agent
        urls = await self.agents.resolve(name)
        protocol = self.agents.protocol(name)
        checked = run_checks.check_body(request, protocol)
        slots = self._slots.get(name)
        if slots is None:
            slots = self._slots[name] = Slots(self._concurrency)
        try:
            async with slots.use(attempts.slot_wait(deadline)) as queued:
                token = next(self._tokens)
                self._running[token] = (name, request.request_id[:100], time.monotonic())
                tries = attempts.Attempts(self._retry, deadline, self.balancer, urls)
                try:
                    while True:
                        replica = tries.next()
                        try:
                            return await self._attempt(
                                replica, tries.number, request, checked, protocol, deadline, queued
                            )
                        except errors.ItemError as exc:
                            if isinstance(exc, Refused):
                                tries.reroute(await self.agents.moved(name, tries.urls))
                            await tries.again(exc, _not_started(exc))  # raises it when final
                            log.info(
                                "retrying rollout request_id=%r on %s (%s): it did not start",
                                request.request_id[:100],
                                name,
                                exc.reason,
                            )
                finally:
                    del self._running[token]
        except SlotTimeout as exc:
            raise attempts.deadline_passed(
                f"while waiting {exc.queued:.3f} s for one of the {self._concurrency} slots of "
                f"agent {name!r} (--agent-concurrency)",
                agent=name,
                queuedSeconds=f"{exc.queued:.3f}",
            ) from None

    async def _attempt(
        self,
        replica: Replica,
        attempt: int,
        request: rollout_pb2.RunRequest,
        checked: Checked,
        protocol: str,
        deadline: float | None,
        queued: float,
    ) -> tuple[Ran, float]:
        """Attempt number `attempt` (1 = the first) on one replica, in one of its slots: the
        `/run` POST and its reply read. A failure carries `queuedSeconds` (the wait for the
        agent's slot) when the item waited."""
        url = replica.url + RUN_PATH
        if protocol == ENVIRONMENT:
            body = checked.episode_body(request.request_id, attempt - 1)
        else:
            body = checked.payload
        try:
            async with replica.use():
                reply = await upstream.post(
                    self._client,
                    replica,
                    url,
                    body,
                    request_id=request.request_id,
                    item_timeout=request.timeout_seconds,
                    default_timeout=self._default_timeout,
                    deadline=deadline,
                    record=self.metrics.rollout_call,
                    labels=(request.agent,),
                )
            reader = episodes.read_episode_reply if protocol == ENVIRONMENT else _read_rollout
            ran = upstream.read(
                reply, url, reader, request.include_reply, status_error=errors.run_status_error
            )
        except errors.ItemError as exc:
            if exc.metadata.get("queuedSeconds") is None and queued:
                exc.metadata["queuedSeconds"] = f"{queued:.3f}"
            raise
        return ran, reply.seconds


def _read_rollout(body: bytes, url: str, include_reply: bool) -> Ran:
    """An agent's 200 `/run` reply body from `url` as its rollout."""
    return read_rollout(parse_reply(body, url), url, include_reply)


def _not_started(exc: errors.ItemError) -> bool:
    """True when the failed attempt cannot have started the rollout: a refused connection
    (never sent) or an environment server's admission refusal."""
    if isinstance(exc, Refused):
        return True
    return exc.reason == reasons.UPSTREAM_EPISODE_FAILED and exc.retryable


def _response(request_id: str, ran: Ran, seconds: float) -> rollout_pb2.RunResponse:
    """The RunResponse of a finished rollout."""
    scored = ran.scored
    rollout = rollout_pb2.Rollout(
        reward=scored.reward,
        output_json=ran.output_json,
        failure_kind=scored.failure_kind,
        failure_reason=scored.failure_reason,
        verification_skipped=ran.verification_skipped,
        reply_json=scored.reply_json,
    )
    if scored.components:
        rollout.reward_components.update(scored.components)
    for turn in ran.turns:
        rollout.turns.add(
            prompt_token_ids=turn.prompt_token_ids,
            generation_token_ids=turn.generation_token_ids,
            generation_log_probs=turn.generation_log_probs,
        )
    return rollout_pb2.RunResponse(request_id=request_id, rollout=rollout, latency_seconds=seconds)
