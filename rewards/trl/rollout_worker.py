"""`create_nemo_gym_rollout_worker`: NeMo Gym rollouts for TRL 1.16's asynchronous GRPO
(`trl.experimental.async_grpo.AsyncGRPOTrainer(rollout_worker=...)`), trained on as they finish.

What TRL does around it (`async_grpo_trainer.py`, `RolloutWorkerProtocol`): it calls `start()`
once after the first weight sync, drains `rollout_buffer` (a `queue.Queue` of `RolloutSample`)
into its batches (and drops samples more than `max_staleness` versions old itself too), calls
`update_model_version(v)` after every weight sync, `check_health(s)` whenever the buffer stayed
empty for its poll interval, drains `metrics_queue` into its logs and calls `stop()` when
training ends.

What the worker does: a thread of its own runs the engine (`worker_engine.py`: rollouts kept
in flight on the long-lived feed of `client/live.py`, groups of `num_generations` rollouts per
dataset row); a complete group becomes samples as `groups.py` says (failed and stale rollouts
left out, small groups dropped, advantages as TRL's own worker computes them).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from nemo_gym_grpc.rewards.client import settings
from nemo_gym_grpc.rewards.client.live import STOP_WAIT
from nemo_gym_grpc.rewards.client.stream import Route
from nemo_gym_grpc.rewards.trl.worker_engine import Engine, Shared, WorkerSettings

log = logging.getLogger("nemo_gym_grpc.rewards")


class NemoGymRolloutWorker:
    """TRL's `RolloutWorkerProtocol` over the bridge (see the module docstring).

    Attributes:
        rollout_buffer: `queue.Queue` of TRL `RolloutSample`s, drained by the trainer.
        metrics_queue: `queue.Queue` of metric dicts, drained into TRL's logs.
        counts: running totals (a `Counter`; names in `worker_engine.py`).
        target: the bridge's gRPC target once started (an embedded bridge's when none given).
        config: the resolved settings.
    """

    def __init__(self, rows: Iterable[Mapping[str, Any]], config: WorkerSettings) -> None:
        self.config = config
        self._rows = rows
        self._shared = Shared()
        self.rollout_buffer = self._shared.rollout_buffer
        self.metrics_queue = self._shared.metrics_queue
        self.counts = self._shared.counts
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._error: BaseException | None = None

    @property
    def target(self) -> str:
        """The bridge's gRPC target ("" before `start()` when an embedded bridge is used)."""
        return self._shared.target or self.config.route.target or ""

    @property
    def model_version(self) -> int:
        """The model version the trainer last announced (`update_model_version`)."""
        return self._shared.version

    def update_model_version(self, model_version: int) -> None:
        """The policy now live is `model_version`: rollouts sent from now on are tagged with
        it, and groups finishing from now on leave out rollouts more than `max_staleness`
        versions older."""
        self._shared.version = int(model_version)

    def start(self) -> None:
        """Start the worker thread (once; again is a warning). Without a `target`, this
        starts (or reuses) the embedded bridge over `NEMO_GYM_HEAD_URL` first.

        Raises:
            RuntimeError: the embedded bridge could not be started.
        """
        if self._thread is not None:
            log.warning("NemoGymRolloutWorker.start() called again; ignored")
            return
        self._shared.target = self.config.route.address()
        self._started = time.monotonic()  # the bridge counts as down until the feed runs
        self._thread = threading.Thread(target=self._main, name="nemo-gym-rollouts", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            asyncio.run(Engine(self.config, self._rows, self._shared).run())
        except BaseException as exc:  # noqa: BLE001 (kept for check_health)
            self._error = exc
            log.error("the NeMo Gym rollout worker stopped: %r", exc)

    def stop(self) -> None:
        """Cancel every rollout in flight (the bridge closes the agents' `/run` requests),
        end the worker thread (bounded wait) and drop unfinished groups. Idempotent."""
        self._shared.stop.set()
        wake = self._shared.wake
        if wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                wake()
        if self._thread is not None:
            self._thread.join(STOP_WAIT + 5.0)

    def check_health(self, stale_after_s: float) -> None:
        """Raise RuntimeError if the worker has failed, or if no stream to the bridge has
        been open for more than `stale_after_s` seconds (bridge down or unreachable)."""
        if self._error is not None:
            raise RuntimeError("the NeMo Gym rollout worker has failed") from self._error
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._shared.stop.is_set():
            raise RuntimeError("the NeMo Gym rollout worker thread has ended")
        feed = self._shared.feed
        down_since = self._started if feed is None else feed.down_since
        if thread is not None and down_since is not None:
            down = time.monotonic() - down_since
            if down > stale_after_s:
                last = None if feed is None else feed.last_failure
                cause = f"; last failure: {last.cause}: {last.message[:300]}" if last else ""
                raise RuntimeError(
                    f"no RunStream to the bridge at {self.target} for {down:.0f} s (more "
                    f"than {stale_after_s:g} s){cause}"
                )


def create_nemo_gym_rollout_worker(
    rows: Iterable[Mapping[str, Any]],
    args: Any,
    agent: str | None = None,
    *,
    num_generations: int | None = None,
    max_inflight: int | None = None,
    max_staleness: int | None = None,
    min_group_size: int = 2,
    queue_maxsize: int | None = None,
    row_column: str = "verify_extra",
    target: str | None = None,
    run_timeout: float | None = None,
    stream_timeout: float | None = None,
    trainer_sampling: bool = True,
) -> NemoGymRolloutWorker:
    """A rollout worker for `AsyncGRPOTrainer(rollout_worker=...)` (see the module docstring).

    Args:
        rows: the dataset rows, re-iterable (the trainer's `train_dataset`, a list); each a
            dict with `prompt` (what TRL logs) and the NeMo Gym row in `row_column`, or a
            NeMo Gym row itself, as for `create_nemo_gym_rollout_func`.
        args: the trainer's `AsyncGRPOConfig`; the settings below left None come from it.
        agent: the agent (or environment server) for rows without `agent_ref.name`.
        num_generations: keyword: rollouts per group (`args.num_generations`).
        max_inflight: keyword: most rollouts in flight (`args.max_inflight_tasks`, or when
            that is -1, TRL's own rule: max(max_staleness, 1) x per_device_train_batch_size x
            gradient_accumulation_steps x world_size).
        max_staleness: keyword: versions a rollout may lag behind (`args.max_staleness`).
        min_group_size: keyword: fewest usable rollouts a group trains with (default 2; a
            group of one has advantage 0).
        queue_maxsize: keyword: no new rollouts while the buffer holds this many samples
            (`args.queue_maxsize`; 0 = no bound).
        row_column: keyword: the dataset column holding the NeMo Gym row.
        target: keyword: the bridge's gRPC target (`NEMO_GYM_GRPC_TARGET`; unset too = an
            embedded bridge over `NEMO_GYM_HEAD_URL`, started by `start()`).
        run_timeout: keyword: seconds per rollout's `/run` (`NEMO_GYM_GRPC_RUN_TIMEOUT`).
        stream_timeout: keyword: gRPC deadline of each RunStream, seconds
            (`NEMO_GYM_GRPC_ROLLOUT_BATCH_TIMEOUT`, 10800); a stream takes new rollouts for
            the first half of it.
        trainer_sampling: keyword: set `temperature` and `top_p` of every row's
            `responses_create_params` to `args.temperature` / `args.top_p` (default True).

    Raises:
        ValueError: a setting is out of range; an env var is invalid.
        TypeError: `rows` is a one-shot iterator.
        ImportError: TRL has no `trl.experimental.async_grpo` (TRL < 1.16).
    """
    check_rows_and_trl(rows)
    limits = group_limits(args, num_generations, max_inflight, max_staleness, min_group_size)
    config = WorkerSettings(
        **limits,
        sampling=row_sampling(args, trainer_sampling),
        queue_maxsize=args.queue_maxsize if queue_maxsize is None else queue_maxsize,
        agent=agent,
        row_column=row_column,
        route=stream_route(target, stream_timeout),
        run_timeout=seconds(run_timeout, "run_timeout", settings.run_timeout),
    )
    return NemoGymRolloutWorker(rows, config)


def check_rows_and_trl(rows: Iterable[Mapping[str, Any]]) -> None:
    """Raise ImportError when TRL has no `trl.experimental.async_grpo` (TRL < 1.16), else
    TypeError when `rows` is a one-shot iterator."""
    try:  # found, not imported: importing it loads TRL's trainer (torch), seconds
        found = importlib.util.find_spec("trl.experimental.async_grpo") is not None
    except ImportError:
        found = False
    if not found:
        raise ImportError(
            "create_nemo_gym_rollout_worker needs TRL >= 1.16 (trl.experimental.async_grpo)"
        )
    if iter(rows) is rows:
        raise TypeError("rows must be re-iterable (a Dataset or a list), not an iterator")


def group_limits(
    args: Any,
    num_generations: int | None,
    max_inflight: int | None,
    max_staleness: int | None,
    min_group_size: int,
) -> dict[str, int]:
    """The `WorkerSettings` fields num_generations, max_inflight, max_staleness and
    min_group_size: each value given, else the one `args` (`AsyncGRPOConfig`) holds, as
    `create_nemo_gym_rollout_worker` documents.

    Raises:
        ValueError: a value is out of range.
    """
    staleness = args.max_staleness if max_staleness is None else max_staleness
    inflight = max_inflight or args.max_inflight_tasks
    if inflight is None or inflight < 0:  # TRL's rule for max_inflight_tasks=-1
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        inflight = max(staleness, 1) * per_step * getattr(args, "world_size", 1)
    size = num_generations or args.num_generations
    if size < 1 or inflight < 1 or staleness < 0 or not 1 <= min_group_size <= size:
        raise ValueError(
            f"num_generations ({size}) and max_inflight ({inflight}) must be >= 1, "
            f"max_staleness ({staleness}) >= 0, min_group_size ({min_group_size}) within "
            "1..num_generations"
        )
    return {
        "num_generations": size,
        "max_inflight": int(inflight),
        "max_staleness": int(staleness),
        "min_group_size": min_group_size,
    }


def row_sampling(args: Any, trainer_sampling: bool) -> dict[str, float] | None:
    """`temperature` and `top_p` for every row's `responses_create_params`: `args.temperature`
    and `args.top_p` (`AsyncGRPOConfig`), or None (rows keep theirs) without `trainer_sampling`.
    """
    sampling = {"temperature": float(args.temperature), "top_p": float(args.top_p)}
    return sampling if trainer_sampling else None


def stream_route(target: str | None, stream_timeout: float | None) -> Route:
    """The route of the worker's RunStreams: `target` as `Route.resolve` takes it, with the
    gRPC deadline `stream_timeout` (else `NEMO_GYM_GRPC_ROLLOUT_BATCH_TIMEOUT`).

    Raises:
        ValueError: `stream_timeout` is not a positive number of seconds; an env var is invalid.
    """
    return Route.resolve(
        target=target,
        timeout=seconds(stream_timeout, "stream_timeout", settings.rollout_batch_timeout),
    )


def seconds(value: float | None, name: str, from_env: Callable[[], float]) -> float:
    """`value` (the keyword `name`) checked as seconds when given, else `from_env()`.

    Raises:
        ValueError: `value` is not a positive number of seconds.
    """
    return settings.resolve(settings.optional(settings.check_seconds, value, name), from_env)
