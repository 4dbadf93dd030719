"""The rollout worker's engine (`rollout_worker.py` is its TRL face): on one asyncio loop, it
keeps up to `max_inflight` rollouts in flight on the long-lived feed of `client/live.py` (one
`RunStream` call at a time to the route's bridge, rotated before its deadline, its rollouts
sent again when it fails), sends the next rollout as each result returns, and turns complete
groups into samples (`groups.py`).

Rows: the dataset is walked in order, again and again, each row `num_generations` times: one
group per row drawn (`group_id` 0, 1, ...). The NeMo Gym row a dataset row gives is
`rows.nemo_gym_row`'s and its requests are `rollouts.build_requests`' (the same as for
`create_nemo_gym_rollout_func`); each rollout is tagged with the model version current when it
is written on a call (again, when it is sent again). No rollout is sent while the buffer holds
`queue_maxsize` samples (0: no bound).

Counted in `Shared.counts` and pushed to `metrics_queue` (TRL's logs) after each group as
`nemo_gym/<name>_total`: `rollouts`, `failed_rollouts`, `stale_rollouts`, `dropped_groups`,
`groups`, `samples`, `resent_rollouts` and `streams` (the feed's), and `failures/<kind>` per
failed rollout (NeMo Gym's `failure_kind`, e.g. `judge_failed`, as the bridge passes it on in
the error's metadata, else the error's reason or code); also `rollout/inflight`,
`rollout/duration_s` (the bridge's `/run` latency, as a rate) and `rollout/straggling` (the
rollouts in flight far longer than their agent's others, `nemo_gym_grpc.shared.stragglers`,
also logged). What `stop()` cancels counts as `cancelled_rollouts`, and the groups it leaves
unfinished as `unfinished_groups` and in `dropped_groups`.
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

from nemo_gym_grpc.rewards.client import policy, rollouts
from nemo_gym_grpc.rewards.client.live import RunFeed
from nemo_gym_grpc.rewards.client.outcomes import Failure, RunOutcome
from nemo_gym_grpc.rewards.client.stream import Route
from nemo_gym_grpc.rewards.trl import groups
from nemo_gym_grpc.rewards.trl.rows import nemo_gym_row
from nemo_gym_grpc.shared import stragglers
from nemo_gym_grpc.v1 import rollout_pb2

log = logging.getLogger("nemo_gym_grpc.rewards")

TICK = 0.5  # s, the loop's longest sleep (stop requests, stream rotation, backpressure)
MAX_FAILURE_NAMES = 32  # distinct `failures/<kind>` counts; further kinds count as `other`


@dataclass(frozen=True)
class WorkerSettings:
    """A worker's settings, resolved (each is described by `create_nemo_gym_rollout_worker`;
    `route.timeout` is the stream deadline, `stream_timeout`)."""

    agent: str | None
    num_generations: int
    max_inflight: int
    max_staleness: int
    min_group_size: int
    queue_maxsize: int
    row_column: str
    route: Route
    run_timeout: float
    sampling: Mapping[str, Any] | None


@dataclass
class Shared:
    """What the trainer's thread and the engine's loop share.

    Attributes:
        target: the bridge's gRPC target ("" until the worker starts).
        rollout_buffer: samples for the trainer.
        metrics_queue: metric dicts for the trainer's logs (bounded; full = dropped).
        counts: running totals (names: the module docstring).
        version: the model version the trainer announced last.
        stop: set to end the engine (it cancels every stream).
        wake: wakes the engine's loop (from any thread); set by the engine.
        feed: the engine's feed once it runs (its `down_since`, `last_failure`), else None.
    """

    target: str = ""
    rollout_buffer: queue.Queue[Any] = field(default_factory=queue.Queue)
    metrics_queue: queue.Queue[dict[str, Any]] = field(
        default_factory=lambda: queue.Queue(maxsize=4096)
    )
    counts: Counter[str] = field(default_factory=Counter)
    version: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    wake: Callable[[], None] | None = None
    feed: RunFeed | None = None


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
    group: groups.Group
    index: int
    version: int
    agent: str
    sent_at: float = field(default_factory=time.monotonic)


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
        self.ready: deque[tuple[groups.Group, int]] = deque()
        self.flying: dict[str, _Flying] = {}
        self.wake = asyncio.Event()
        self.pushed: Counter[str] = Counter()  # counts already in a metrics push
        self.stragglers = stragglers.Stragglers(log, "the rollout worker")
        self.straggling = 0

    async def run(self) -> None:
        """Keep rollouts in flight until `shared.stop` is set; then cancel them.

        Raises:
            RuntimeError: the bridge refused the stream for good (`RunFeed.tick`).
        """
        loop = asyncio.get_running_loop()

        def wake() -> None:
            loop.call_soon_threadsafe(self.wake.set)

        self.shared.wake = wake
        feed = RunFeed(
            self.config.route,
            self.shared.target,
            self._on_result,
            on_send=self._on_send,
            counts=self.shared.counts,
        )
        self.shared.feed = feed
        checked = time.monotonic()
        async with feed:
            while not self.shared.stop.is_set():
                if await feed.tick():
                    await self._feed(feed)
                try:
                    await asyncio.wait_for(self.wake.wait(), TICK)
                except asyncio.TimeoutError:
                    pass
                self.wake.clear()
                if time.monotonic() - checked >= stragglers.CHECK_EVERY:
                    checked = time.monotonic()
                    self._check_stragglers()
        self._count_dropped()

    def _check_stragglers(self) -> None:
        running = (
            (f.agent, f"group {f.group.group_id} rollout {f.index} ({key})", f.sent_at)
            for key, f in self.flying.items()
        )
        self.straggling = sum(self.stragglers.check(running).values())

    def _count_dropped(self) -> None:
        """Count what the stop cut, and push the counts: the rollouts in flight (cancelled) and
        every group drawn that did not complete (dropped)."""
        if not self.requests:
            return
        cut, cancelled = len(self.requests), len(self.flying)
        self.shared.counts.update(
            cancelled_rollouts=cancelled, unfinished_groups=cut, dropped_groups=cut
        )
        log.info("stopped: %d rollouts in flight cancelled, %d groups dropped", cancelled, cut)
        self._push_metrics(None)

    async def _feed(self, feed: RunFeed) -> None:
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
                flying = _Flying(group, index, self.shared.version, request.agent)
                self.flying[request.request_id] = flying
                batch.append(request)
        if batch:
            await feed.send(batch)

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
        group = groups.Group(self.next_group, prompt, size)
        requests: list[rollout_pb2.RunRequest | Failure] = [*batch.requests]
        for index, failure in sorted(batch.rejected.items()):
            requests.insert(index, failure)
        self.requests[group.group_id] = requests
        self.ready.extend((group, index) for index in range(size))
        self.next_group += 1

    def _request(self, group: groups.Group, index: int) -> rollout_pb2.RunRequest | None:
        """The RunRequest of a group's rollout, or None after answering it with its local
        failure (a row that cannot be sent)."""
        built = self.requests[group.group_id][index]
        if isinstance(built, Failure):
            self._record(group, groups.Result(index, self.shared.version, built))
            return None
        return built

    def _on_send(self, request_id: str) -> None:
        """A rollout is written on a call (again): it starts under the version now."""
        flying = self.flying.get(request_id)
        if flying is not None:
            flying.version = self.shared.version
            flying.sent_at = time.monotonic()

    def _on_result(self, request_id: str, outcome: RunOutcome) -> None:
        flying = self.flying.pop(request_id, None)
        if flying is None:
            return
        if not isinstance(outcome, Failure):
            self.stragglers.finished(flying.agent, time.monotonic() - flying.sent_at)
        self._record(flying.group, groups.Result(flying.index, flying.version, outcome))
        self.wake.set()

    def _record(self, group: groups.Group, result: groups.Result) -> None:
        group.results.append(result)
        if group.complete:
            self._close(group)

    def _close(self, group: groups.Group) -> None:
        """A complete group's samples into the buffer; counts, metrics, a warning on failures."""
        config = self.config
        verdict = groups.close(
            group,
            version=self.shared.version,
            max_staleness=config.max_staleness,
            min_group_size=config.min_group_size,
        )
        del self.requests[group.group_id]
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

    def _push_metrics(self, group: groups.Group | None) -> None:
        """The counts since the last push, the gauges and (`group`: the group just closed, or
        None) its rollouts' durations, onto `metrics_queue` (dropped when it is full)."""
        counts = self.shared.counts
        metrics: dict[str, Any] = {
            f"nemo_gym/{name}_total": float(counts[name] - self.pushed[name]) for name in counts
        }
        self.pushed = Counter(counts)
        metrics["rollout/inflight"] = float(len(self.flying))
        metrics["rollout/straggling"] = float(self.straggling)
        results = group.results if group is not None else []
        latencies = [
            r.outcome.latency_seconds for r in results if not isinstance(r.outcome, Failure)
        ]
        if latencies:
            metrics["rollout/duration_s"] = (float(sum(latencies)), float(len(latencies)))
        try:
            self.shared.metrics_queue.put_nowait(metrics)
        except queue.Full:
            pass  # the trainer stopped draining: never block the rollouts
