"""`nemo-gym-grpc score ROWS.jsonl -o OUT.jsonl`: re-verify saved rollouts through the bridge.

Rows (NeMo Gym dataset rows with the `response` a rollout saved; see `scorefile.py`) are read
lazily and sent in batches of `--batch-size` rows, each batch one `VerifyStream` call, at most
`--concurrency` calls at once, to a running bridge (`--target`; TLS and token from the
environment, `settings.py`) or to an embedded one that discovers servers from `--head-url`
(`embedded.py`). Everything runs on one asyncio event loop. Finished batches wait in a
reorder buffer (at most 2 x `--concurrency` batches) and are appended to OUT strictly in input
order and flushed, so OUT is always the records of an input prefix:

- resume: running the same command again skips the rows already in OUT (checked by line
  number and hash) and appends the rest; a last line cut short by a crash is dropped first;
- Ctrl-C (SIGINT) or SIGTERM: stop sending, keep every batch that finished in order, cancel
  the calls in flight (the bridge cancels their `/verify` calls), print the summary, exit
  130; a second Ctrl-C aborts at once (OUT is still a valid prefix);
- a call that fails as a whole (no connection, deadline, bridge restarting) is retried for
  the items it left unanswered (3 attempts in all for UNAVAILABLE, DEADLINE_EXCEEDED and
  RESOURCE_EXHAUSTED); if it still fails, or fails otherwise (e.g. UNAUTHENTICATED), the run
  stops with exit status 1 and nothing of that batch is written, so a rerun scores it.
  Per-row failures that the bridge reports (unknown server, upstream errors, ...) are
  results: they are written and counted.

A progress bar (tqdm, items/s) goes to stderr; the summary table (per resources server: rows,
scored, mean reward, failures by cause) to stdout, covering all of OUT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from nemo_gym_grpc.rewards.client import channels, embedded, settings, stream
from nemo_gym_grpc.rewards.client.outcomes import Failure, Outcome, ProtocolError
from nemo_gym_grpc.rewards.tools import scorefile

CALL_ATTEMPTS = 3
CALL_BACKOFF = 1.0  # seconds before attempt n + 1: n x this (1 s, then 2 s)
RETRYABLE_CALL_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})
EXIT_INTERRUPTED = 130

log = logging.getLogger(__name__)

Record = dict[str, Any]


class CallFailed(RuntimeError):
    """A batch's call failed as a whole and retrying did not help; the run stops."""


def _chunks(rows: Iterator[scorefile.Row], size: int) -> Iterator[list[scorefile.Row]]:
    chunk: list[scorefile.Row] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class FileScorer:
    """One run over the pending rows, on the running event loop: batches out, records
    appended to OUT in input order.

    Args:
        target: the bridge's gRPC target.
        security: token (and TLS files) for each call.
        batch_timeout, connect_timeout: seconds (see `stream.verify_batch`).
        concurrency: calls in flight at once.
        stop: set it (e.g. from a signal handler) to end the run early.
    """

    def __init__(
        self,
        target: str,
        security: channels.Security,
        *,
        batch_timeout: float,
        connect_timeout: float,
        concurrency: int,
        stop: asyncio.Event,
    ) -> None:
        self.target = target
        self.security = security
        self.batch_timeout = batch_timeout
        self.connect_timeout = connect_timeout
        self.concurrency = concurrency
        self.stop = stop
        self.calls = asyncio.Semaphore(concurrency)
        self.written = 0

    async def score_chunk(self, rows: Sequence[scorefile.Row]) -> list[Record]:
        """The records of `rows`, in order. A call that fails as a whole is retried for the
        items it left unanswered.

        Raises:
            CallFailed: the call kept failing as a whole.
            ProtocolError: the bridge broke the VerifyStream contract.
        """
        todo = [row.request for row in rows if row.request is not None]
        outcomes: dict[str, Outcome] = {}
        async with self.calls:
            for attempt in range(1, CALL_ATTEMPTS + 1):
                if not todo:
                    break
                sent = await stream.verify_batch_async(
                    self.target,
                    todo,
                    timeout=self.batch_timeout,
                    connect_timeout=self.connect_timeout,
                    security=self.security,
                )
                failure: Failure | None = None
                for request_id, outcome in sent.items():
                    if isinstance(outcome, Failure) and outcome.whole_call:
                        failure = outcome
                    else:
                        outcomes[request_id] = outcome
                todo = [request for request in todo if request.request_id not in outcomes]
                if failure is None:
                    break
                if failure.code not in RETRYABLE_CALL_CODES or attempt == CALL_ATTEMPTS:
                    raise CallFailed(
                        f"a call to the bridge at {self.target} failed as a whole "
                        f"({attempt} attempt{'s' if attempt > 1 else ''}): {failure.cause}: "
                        f"{failure.message}"
                    )
                log.warning(
                    "call failed as a whole (%s); retrying its %d rows", failure.cause, len(todo)
                )
                await asyncio.sleep(attempt * CALL_BACKOFF)
        return [scorefile.record(row, row.failure or outcomes[row.request_id]) for row in rows]

    async def run(
        self,
        rows: Iterator[scorefile.Row],
        batch_size: int,
        out: BinaryIO,
        on_write: Callable[[list[Record]], None],
    ) -> bool:
        """Score `rows`, appending records to the binary file `out` in input order.

        At most `concurrency` calls are in flight and 2 x `concurrency` batches are started
        ahead of the first unwritten one. `on_write(records)` is called after each flushed
        write. Returns True when every row was written, False when stopped early; the calls
        still in flight are cancelled before it returns.

        Raises:
            CallFailed, ProtocolError: from a batch; OUT keeps the prefix before it.
        """
        chunks = _chunks(rows, batch_size)
        started: deque[asyncio.Task[list[Record]]] = deque()  # in input order
        stopped = asyncio.ensure_future(self.stop.wait())
        exhausted = False
        try:
            while True:
                while not exhausted and not self.stop.is_set():
                    if len(started) == 2 * self.concurrency:
                        break
                    chunk = next(chunks, None)
                    if chunk is None:
                        exhausted = True
                    else:
                        started.append(asyncio.create_task(self.score_chunk(chunk)))
                if exhausted and not started:
                    return True
                await asyncio.wait([*started, stopped], return_when=asyncio.FIRST_COMPLETED)
                for task in started:
                    error = task.exception() if task.done() else None
                    if error is not None:
                        raise error
                while started and started[0].done():
                    records = started.popleft().result()
                    out.write(b"".join(scorefile.dumps(r) for r in records))
                    out.flush()
                    self.written += len(records)
                    on_write(records)
                if self.stop.is_set():
                    return False
        finally:
            stopped.cancel()
            for task in started:
                task.cancel()
            await asyncio.gather(stopped, *started, return_exceptions=True)


def output_problem(path: Path) -> str | None:
    """Why the file at `path` cannot be written (appended to, replaced or created; a missing
    folder is not created), or None. `score` and `export` check OUT with it before any work."""
    if path.is_dir():
        return f"{path} is a directory"
    if path.exists():
        return None if os.access(path, os.W_OK) else f"{path} is not writable"
    folder = path.parent
    if not folder.is_dir():
        return f"cannot create {path}: folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot create {path}: folder {folder} is not writable"
    return None


def run_score(args: argparse.Namespace) -> int:
    """Run `score` with the parsed arguments of the `score` parser (bridge/cli.py):
    `rows`, `output` (Paths), `server`, `target`, `head_url` (str or None), `batch_size`,
    `concurrency` (int), `timeout` (seconds, 0 = the bridge's), `batch_timeout` (seconds or
    None), `no_progress` (bool).

    Returns the exit status: 0 done (per-row failures included), 1 an error (bad input/OUT,
    no bridge, a call that kept failing), 2 an OUT that cannot be written, 130 stopped by
    SIGINT/SIGTERM (rerun the same command to resume)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    problem = output_problem(args.output)
    if problem:
        print(f"nemo-gym-grpc score: error: -o/--output: {problem}", file=sys.stderr)
        return 2
    try:
        start = scorefile.plan(args.rows, args.output)
    except (OSError, scorefile.OutputMismatch) as exc:
        print(f"nemo-gym-grpc score: {exc}", file=sys.stderr)
        return 1
    if start.dropped_bytes:
        print(
            f"dropped an incomplete last line ({start.dropped_bytes} bytes) from {args.output}",
            file=sys.stderr,
        )
    status = 0
    if start.done < start.total:
        try:
            status = asyncio.run(_score_rest(args, start))
        except KeyboardInterrupt:  # a Ctrl-C just before or after the loop's own handlers
            print("aborted", file=sys.stderr)
            status = EXIT_INTERRUPTED
    summary = start.summary
    print(summary.table())
    print(f"{summary.rows} of {start.total} rows in {args.output} ({summary.failed} failed)")
    return status


async def _score_rest(args: argparse.Namespace, start: scorefile.Plan) -> int:
    """The scoring part of `run_score`, with SIGINT/SIGTERM handled on the event loop: the
    first stops the run, the second cancels it at once."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main = asyncio.current_task()

    def on_signal(signum: signal.Signals) -> None:
        if stop.is_set():
            if main is not None:
                main.cancel()
            return
        stop.set()
        print(
            f"\n{signum.name}: stopping; rows scored so far are kept (Ctrl-C again to abort now)",
            file=sys.stderr,
        )

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await _connect_and_score(args, start, stop)
    except asyncio.CancelledError:  # a second signal
        print("aborted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _ready(
    target: str, security: channels.Security, timeout: float, stop: asyncio.Event
) -> bool:
    """True once a channel to `target` is ready; False after `timeout` s or on `stop`."""
    async with channels.aio_channel(target, security) as channel:
        waits = [asyncio.ensure_future(channel.channel_ready()), asyncio.ensure_future(stop.wait())]
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        return waits[0] in done


async def _connect_and_score(
    args: argparse.Namespace, start: scorefile.Plan, stop: asyncio.Event
) -> int:
    from tqdm import tqdm  # only the score command needs it

    configured = None if args.head_url else (args.target or settings.target())
    try:
        security = settings.security(tls=configured is not None)
        batch_timeout = settings.resolve(args.batch_timeout, settings.batch_timeout)
        connect_timeout = settings.connect_timeout()
        if configured is None:
            head_url = settings.resolve(args.head_url, settings.head_url).rstrip("/")
            spec = embedded.BridgeSpec(head_url=head_url)
            target = await asyncio.to_thread(embedded.ensure_bridge, spec)
        else:
            target = configured
    except (ValueError, RuntimeError) as exc:
        print(f"nemo-gym-grpc score: {exc}", file=sys.stderr)
        return 1
    if not await _ready(target, security, connect_timeout, stop):
        if stop.is_set():
            return EXIT_INTERRUPTED
        print(
            f"nemo-gym-grpc score: no connection to the bridge at {target} within "
            f"{connect_timeout:g} s ({settings.CONNECT_TIMEOUT_ENV})",
            file=sys.stderr,
        )
        return 1
    print(
        f"scoring {start.total - start.done} rows of {args.rows} through the bridge at "
        f"{target} ({start.done} already in {args.output})",
        file=sys.stderr,
    )
    scorer = FileScorer(
        target,
        security,
        batch_timeout=batch_timeout,
        connect_timeout=connect_timeout,
        concurrency=args.concurrency,
        stop=stop,
    )
    rows = scorefile.pending_rows(args.rows, start.resume_after, args.server, args.timeout)
    bar = tqdm(
        total=start.total,
        initial=start.done,
        unit="item",
        desc="scoring",
        file=sys.stderr,
        disable=args.no_progress,
        dynamic_ncols=True,
    )

    def on_write(records: list[Record]) -> None:
        for rec in records:
            start.summary.add(rec)
        bar.update(len(records))
        bar.set_postfix(failed=start.summary.failed, refresh=False)

    try:
        with open(args.output, "ab") as out:  # noqa: ASYNC230 - small appends, in order
            complete = await scorer.run(rows, args.batch_size, out, on_write)
    except (CallFailed, ProtocolError, OSError) as exc:
        print(
            f"nemo-gym-grpc score: stopped: {exc}\n{start.summary.rows} rows are in "
            f"{args.output}; rerun the same command to continue",
            file=sys.stderr,
        )
        return 1
    finally:
        bar.close()
    if not complete:
        print(
            f"interrupted: {scorer.written} rows scored in this run are kept in "
            f"{args.output}; rerun the same command to score the rest",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    return 0
