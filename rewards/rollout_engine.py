"""The rollout worker's engine (`trl_async.py` is its TRL face): on one asyncio loop, it keeps
up to `max_inflight` rollouts in flight on a long-lived `RunStream` (`live_stream.py`), sends
the next rollout as each result returns, and turns complete groups into samples
(`rollout_groups.py`).

Rows: the dataset is walked in order, again and again, each row `num_generations` times: one
group per row drawn (`group_id` 0, 1, ...). The NeMo Gym row a dataset row gives is
`trl_rollouts.nemo_gym_row`'s and its requests are `rollouts.build_requests`' (the same as for
`create_nemo_gym_rollout_func`); each rollout is tagged with the model version current when it
is sent. No rollout is sent while the buffer holds `queue_maxsize` samples (0: no bound).

Streams: a stream takes new rollouts for the first half of its gRPC deadline (`stream_timeout`),
then is half-closed (the bridge finishes what it holds and ends it OK) and a new one takes
over: no call lives without a deadline, and every rollout has at least half of one. A stream
that fails as a whole (bridge restarted, connection lost) has its rollouts in flight sent again
on the next stream (they may be fine; counted as `resent_rollouts`), after a pause growing
with the failures in a row (RECONNECT_DELAYS). A call-level failure that sending again cannot
fix (PERMANENT: token refused, no such service, a message refused) ends the engine with
RuntimeError. The bridge counts as down (`Shared.down_since`) from the start, and from a
stream failure, until a result arrives or a stream has stayed open SETTLED_SECONDS.

Counted in `Shared.counts` and pushed to `metrics_queue` (TRL's logs) after each group as
`nemo_gym/<name>_total`: `rollouts`, `failed_rollouts`, `stale_rollouts`, `dropped_groups`,
`groups`, `samples`, `resent_rollouts`, `streams`, and `failures/<kind>` per failed rollout
(NeMo Gym's `failure_kind`, e.g. `judge_failed`, as the bridge passes it on in the error's
metadata, else the error's reason or code); also `rollout/inflight` and `rollout/duration_s`
(the bridge's `/run` latency, as a rate).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from nemo_gym_grpc.rewards import channels, policy, rollout_groups, rollouts
from nemo_gym_grpc.rewards.live_stream import LiveRunStream
from nemo_gym_grpc.rewards.outcomes import Failure, RunOutcome
from nemo_gym_grpc.rewards.trl_rollouts import nemo_gym_row
from nemo_gym_grpc.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger("nemo_gym_grpc.rewards")

SETTLED_SECONDS = 2.0  # a stream open this long without failing: the bridge counts as up
RECONNECT_DELAYS = (0.5, 1.0, 2.0, 5.0)  # s before reopening after the n-th failure in a row
TICK = 0.5  # s, the loop's longest sleep (stop requests, stream rotation, backpressure)
STOP_WAIT = 10.0  # s, how long a stop waits for the cancelled streams to end
MAX_FAILURE_NAMES = 32  # distinct `failures/<kind>` counts; further kinds count as `other`
# Call-level codes that sending again cannot fix.
PERMANENT = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED", "INVALID_ARGUMENT"})


@dataclass(frozen=True)
class WorkerSettings:
    """A worker's settings, resolved (each is described by `create_nemo_gym_rollout_worker`)."""

    agent: str | None
    num_generations: int
    max_inflight: int
    max_staleness: int
    min_group_size: int
    queue_maxsize: int
    row_column: str
    target: str | None
    security: channels.Security
    run_timeout: float
    stream_timeout: float
    sampling: Mapping[str, Any] | None


@dataclass
class Shared:
    """What the trainer's thread and the engine's loop share.

    Attributes:
        target: the bridge's gRPC target.
        rollout_buffer: samples for the trainer.
        metrics_queue: metric dicts for the trainer's logs (bounded; full = dropped).
        counts: running totals (names: the module docstring).
        version: the model version the trainer announced last.
        stop: set to end the engine (it cancels every stream).
        wake: wakes the engine's loop (from any thread); set by the engine.
        down_since: `time.monotonic()` since when no stream is open, or None.
        last_failure: the last stream failure, or None.
    """

    target: str
    rollout_buffer: queue.Queue[Any] = field(default_factory=queue.Queue)
    metrics_queue: queue.Queue[dict[str, Any]] = field(
        default_factory=lambda: queue.Queue(maxsize=4096)
    )
    counts: Counter[str] = field(default_factory=Counter)
    version: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    wake: Callable[[], None] | None = None
    down_since: float | None = field(default_factory=time.monotonic)
    last_failure: Failure | None = None


def _forever(rows: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    while True:
        empty = True
        for row in rows:
            empty = False
            yield row
        if empty:
            raise ValueError("the rollout worker's dataset has no rows")


@dataclass
class _Flying:
    group: rollout_groups.Group
    index: int
    version: int


class Engine:
    """The engine on its event loop (see the module docstring); `run()` until `shared.stop`."""

    def __init__(
        self, config: WorkerSettings, rows: Iterable[Mapping[str, Any]], shared: Shared
    ) -> None:
        self.shared = shared
        self.config = config
        self.run_id = uuid.uuid4().hex[:12]
        self.rows = _forever(rows)
        self.next_group = 0
        self.requests: dict[int, list[rollout_pb2.RunRequest | Failure]] = {}
        self.attempts: Counter[tuple[int, int]] = Counter()
        self.ready: deque[tuple[rollout_groups.Group, int]] = deque()
        self.flying: dict[str, _Flying] = {}
        self.streams: set[LiveRunStream] = set()
        self.current: LiveRunStream | None = None
        self.failures_in_row = 0
        self.next_open = 0.0
        self.fatal: Failure | None = None
        self.wake = asyncio.Event()
        self.pushed: Counter[str] = Counter()  # counts already in a metrics push

    async def run(self) -> None:
        loop = asyncio.get_running_loop()

        def wake() -> None:
            loop.call_soon_threadsafe(self.wake.set)

        self.shared.wake = wake
        async with channels.aio_channel(self.shared.target, self.config.security) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            try:
                while not self.shared.stop.is_set():
                    await self._tick(channel, stub)
                    try:
                        await asyncio.wait_for(self.wake.wait(), TICK)
                    except asyncio.TimeoutError:
                        pass
                    self.wake.clear()
            finally:
                for stream in list(self.streams):
                    stream.cancel()
                ends = [asyncio.ensure_future(s.wait_ended()) for s in self.streams]
                if ends:
                    await asyncio.wait(ends, timeout=STOP_WAIT)

    async def _tick(
        self, channel: grpc.aio.Channel, stub: rollout_pb2_grpc.RolloutServiceAsyncStub
    ) -> None:
        if self.fatal is not None:
            failure = self.fatal
            raise RuntimeError(
                f"the bridge refused the RunStream: {failure.cause}: {failure.message}"
            )
        current = self.current
        if current is not None and current.age() >= self.config.stream_timeout / 2:
            self.current = None  # rotate: the old one finishes what it holds, then ends OK
            await current.half_close()
            current = None
        if current is None and time.monotonic() >= self.next_open:
            try:
                await asyncio.wait_for(channel.channel_ready(), 1.0)
            except asyncio.TimeoutError:
                self._down("no connection to the bridge")
                return
            current = self.current = self._open(stub)
        if current is None:
            return
        if current.age() >= SETTLED_SECONDS:
            self._up()
        await self._feed(current)

    def _open(self, stub: rollout_pb2_grpc.RolloutServiceAsyncStub) -> LiveRunStream:
        stream = LiveRunStream(
            stub,
            timeout=self.config.stream_timeout,
            metadata=self.config.security.metadata(),
            on_result=self._on_result,
            on_end=self._on_end,
        )
        stream.start()
        self.streams.add(stream)
        self.shared.counts["streams"] += 1
        return stream

    def _up(self) -> None:
        self.shared.down_since = None
        self.failures_in_row = 0

    def _down(self, why: str, failure: Failure | None = None) -> None:
        now = time.monotonic()
        if self.shared.down_since is None:
            self.shared.down_since = now
        self.shared.last_failure = failure or Failure("UNAVAILABLE", None, why)
        delay = RECONNECT_DELAYS[min(self.failures_in_row, len(RECONNECT_DELAYS) - 1)]
        self.failures_in_row += 1
        self.next_open = now + delay

    async def _feed(self, stream: LiveRunStream) -> None:
        """Send rollouts while fewer than `max_inflight` fly and the buffer has room."""
        batch: list[rollout_pb2.RunRequest] = []
        room = self.config.max_inflight - len(self.flying)
        while room > 0 and not self._buffer_full():
            room -= 1  # a rollout answered without being sent takes room until the next tick
            if not self.ready:
                self._draw_group()
            group, index = self.ready.popleft()
            request = self._request(group, index)
            if request is not None:
                self.flying[request.request_id] = _Flying(group, index, self.shared.version)
                batch.append(request)
        for request in reversed(await stream.send(batch) if batch else []):
            flying = self.flying.pop(request.request_id)  # not sent: the stream had ended
            self.ready.appendleft((flying.group, flying.index))

    def _buffer_full(self) -> bool:
        limit = self.config.queue_maxsize
        return limit > 0 and self.shared.rollout_buffer.qsize() >= limit

    def _draw_group(self) -> None:
        """The next dataset row as a new group: its requests built, its rollouts ready."""
        config = self.config
        dataset_row = next(self.rows)
        row = nemo_gym_row(dataset_row, config.row_column)
        prompt = dataset_row.get("prompt")
        if prompt is None:
            params = row.get("responses_create_params")
            prompt = params.get("input") if isinstance(params, Mapping) else None
        size = config.num_generations
        batch = rollouts.build_requests(
            [row] * size,
            agent=config.agent,
            batch_id=f"{self.run_id}-{self.next_group}",
            prompts=[dataset_row["prompt"]] * size if "prompt" in dataset_row else None,
            responses_create_params=config.sampling,
            run_timeout=config.run_timeout,
        )
        group = rollout_groups.Group(self.next_group, prompt, size)
        requests: list[rollout_pb2.RunRequest | Failure] = [*batch.requests]
        for index, failure in sorted(batch.rejected.items()):
            requests.insert(index, failure)
        self.requests[group.group_id] = requests
        self.ready.extend((group, index) for index in range(size))
        self.next_group += 1

    def _request(self, group: rollout_groups.Group, index: int) -> rollout_pb2.RunRequest | None:
        """The RunRequest of a group's rollout (a new request_id when it is sent again), or
        None after answering it with its local failure (a row that cannot be sent)."""
        built = self.requests[group.group_id][index]
        if isinstance(built, Failure):
            self._record(group, rollout_groups.Result(index, self.shared.version, built))
            return None
        attempt = self.attempts[(group.group_id, index)]
        if not attempt:
            return built
        request = rollout_pb2.RunRequest()
        request.CopyFrom(built)
        request.request_id = f"{built.request_id}-r{attempt}"
        return request

    def _on_result(self, request_id: str, outcome: RunOutcome) -> None:
        flying = self.flying.pop(request_id, None)
        if flying is None:
            return
        self._up()  # a result: the bridge works
        result = rollout_groups.Result(flying.index, flying.version, outcome)
        self._record(flying.group, result)
        self.wake.set()

    def _on_end(
        self, stream: LiveRunStream, failure: Failure | None, unanswered: list[str]
    ) -> None:
        self.streams.discard(stream)
        if stream is self.current:
            self.current = None
        self.wake.set()
        if self.shared.stop.is_set():
            return
        for request_id in unanswered:
            flying = self.flying.pop(request_id, None)
            if flying is not None:
                self.attempts[(flying.group.group_id, flying.index)] += 1
                self.ready.appendleft((flying.group, flying.index))
                self.shared.counts["resent_rollouts"] += 1
        if failure is None:
            return
        if failure.code in PERMANENT:
            self.fatal = failure
            return
        log.warning(
            "RunStream to the bridge at %s failed (%s: %s); %d rollouts in flight are sent "
            "again on the next stream",
            self.shared.target,
            failure.cause,
            failure.message[:300],
            len(unanswered),
        )
        self._down("the RunStream failed", failure)

    def _record(self, group: rollout_groups.Group, result: rollout_groups.Result) -> None:
        group.results.append(result)
        if group.complete:
            self._close(group)

    def _close(self, group: rollout_groups.Group) -> None:
        """A complete group's samples into the buffer; counts, metrics, a warning on failures."""
        config = self.config
        verdict = rollout_groups.close(
            group,
            version=self.shared.version,
            max_staleness=config.max_staleness,
            min_group_size=config.min_group_size,
        )
        del self.requests[group.group_id]
        for index in range(group.size):
            self.attempts.pop((group.group_id, index), None)
        counts = self.shared.counts
        counts.update(
            rollouts=group.size,
            failed_rollouts=len(verdict.failures),
            stale_rollouts=verdict.stale,
            dropped_groups=int(verdict.dropped),
            groups=1,
            samples=len(verdict.samples),
        )
        counts.update(self._failure_name(failure) for failure in verdict.failures.values())
        for sample in verdict.samples:
            sample.enqueued_at = time.time()
            self.shared.rollout_buffer.put_nowait(sample)
        if verdict.failures:
            log.warning(
                "group %d: %d of %d rollouts failed, left out of the group%s: %s",
                group.group_id,
                len(verdict.failures),
                group.size,
                " (group dropped)" if verdict.dropped else "",
                policy.summary(verdict.failures),
            )
        self._push_metrics(group)

    def _failure_name(self, failure: Failure) -> str:
        """The count a failed rollout adds to: `failures/<kind>`, kind = NeMo Gym's
        `failure_kind` when the bridge passed it on (`failureKind`), else the failure's
        reason, else its code; at most MAX_FAILURE_NAMES names, then `failures/other`."""
        kind = failure.metadata.get("failureKind") or failure.reason or failure.code
        name = "failures/" + "".join(c if c.isalnum() or c in ":._-" else "_" for c in kind[:64])
        known = sum(1 for key in self.shared.counts if key.startswith("failures/"))
        if name not in self.shared.counts and known >= MAX_FAILURE_NAMES:
            return "failures/other"
        return name

    def _push_metrics(self, group: rollout_groups.Group) -> None:
        counts = self.shared.counts
        metrics: dict[str, Any] = {
            f"nemo_gym/{name}_total": float(counts[name] - self.pushed[name]) for name in counts
        }
        self.pushed = Counter(counts)
        metrics["rollout/inflight"] = float(len(self.flying))
        latencies = [
            r.outcome.latency_seconds for r in group.results if not isinstance(r.outcome, Failure)
        ]
        if latencies:
            metrics["rollout/duration_s"] = (float(sum(latencies)), float(len(latencies)))
        try:
            self.shared.metrics_queue.put_nowait(metrics)
        except queue.Full:
            pass  # the trainer stopped draining: never block the rollouts
