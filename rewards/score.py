"""`nemo-gym-grpc score ROWS.jsonl -o OUT.jsonl`: re-verify saved rollouts through the bridge.

Rows (NeMo Gym dataset rows with the `response` a rollout saved; see `scorefile.py`) are read
lazily and sent in batches of `--batch-size` rows, each batch one `VerifyStream` call, at most
`--concurrency` calls at once, to a running bridge (`--target`, or env
`NEMO_GYM_GRPC_TARGET`; TLS and token from the env vars of `channels.py`) or to an embedded
one that discovers servers from `--head-url` (`embedded.py`). Finished batches wait in a
reorder buffer (at most 2 x `--concurrency` batches) and are appended to OUT strictly in input
order and flushed, so OUT is always the records of an input prefix:

- resume: running the same command again skips the rows already in OUT (checked by line
  number and hash) and appends the rest; a last line cut short by a crash is dropped first;
- Ctrl-C (SIGINT) or SIGTERM: stop sending, keep every batch that finished in order, close
  the channel (the bridge cancels what was in flight), print the summary, exit 130; a
  second Ctrl-C aborts at once (OUT is still a valid prefix);
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
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from nemo_gym_grpc.rewards import channels, client, embedded, scorefile, settings
from nemo_gym_grpc.rewards.client import Failure

CALL_ATTEMPTS = 3
RETRYABLE_CALL_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})
EXIT_INTERRUPTED = 130

log = logging.getLogger(__name__)


class CallFailed(RuntimeError):
    """A batch's call failed as a whole and retrying did not help; the run stops."""


class _Stopped(Exception):
    """The run was asked to stop while this batch was being scored."""


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (bad values exit 2 with a message naming the flag)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _finite(text: str, at_least: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and at_least == "> 0"):
        raise argparse.ArgumentTypeError(f"expected a finite number {at_least}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (e.g. seconds where 0 makes no sense)."""
    return _finite(text, "> 0")


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (for options where 0 has a meaning of its own)."""
    return _finite(text, ">= 0")


def add_score_command(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `score` subcommand on the `nemo-gym-grpc` parser's subparsers."""
    cmd = commands.add_parser(
        "score",
        help="score a JSONL file of NeMo Gym rows with saved responses (rollouts)",
        description=__doc__.split("\n\n")[0],
    )
    cmd.add_argument("rows", type=Path, help="input JSONL: NeMo Gym rows with `response`")
    cmd.add_argument(
        "-o", "--output", type=Path, required=True, help="output JSONL (appended; resumable)"
    )
    cmd.add_argument(
        "--server",
        metavar="NAME",
        help="resources server for rows without resources_server_ref.name",
    )
    where = cmd.add_mutually_exclusive_group()
    where.add_argument(
        "--target",
        help=f"gRPC target of a running bridge (default: env {settings.TARGET_ENV}; "
        "unset = start an embedded bridge)",
    )
    where.add_argument(
        "--head-url",
        help="NeMo Gym head server for an embedded bridge "
        f"(default: env {settings.HEAD_URL_ENV}, else {settings.DEFAULT_HEAD_URL})",
    )
    cmd.add_argument(
        "--batch-size", type=positive_int, default=64, help="rows per call (default 64)"
    )
    cmd.add_argument(
        "--concurrency", type=positive_int, default=4, help="calls in flight at once (default 4)"
    )
    cmd.add_argument(
        "--timeout",
        type=non_negative_float,
        default=0.0,
        help="seconds per /verify (default 0 = the bridge's --verify-timeout)",
    )
    cmd.add_argument(
        "--batch-timeout",
        type=positive_float,
        help=f"gRPC deadline of one call in seconds (default: env {settings.BATCH_TIMEOUT_ENV}, "
        "else 600)",
    )
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")
    return cmd


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
    """One run over the pending rows: batches out, records appended to OUT in order.

    Args:
        connection: the channel to the bridge; `run` closes it (cancelling the calls in
            flight) when it returns.
        security: token (and TLS files) for each call.
        batch_timeout, connect_timeout: seconds (see `client.verify_batch`).
        concurrency: calls in flight at once.
        stop: set it (e.g. from a signal handler) to end the run early.
    """

    def __init__(
        self,
        connection: channels.Connection,
        security: channels.Security,
        *,
        batch_timeout: float,
        connect_timeout: float,
        concurrency: int,
        stop: threading.Event,
    ) -> None:
        self.connection = connection
        self.security = security
        self.batch_timeout = batch_timeout
        self.connect_timeout = connect_timeout
        self.concurrency = concurrency
        self.stop = stop
        self.written = 0

    def score_chunk(self, rows: Sequence[scorefile.Row]) -> list[dict[str, Any]]:
        """The records of `rows`, in order (runs in a worker thread).

        Raises:
            CallFailed: the call kept failing as a whole.
            _Stopped: the run was stopped meanwhile.
            client.ProtocolError: the bridge broke the VerifyStream contract.
        """
        outcomes: dict[int, client.Outcome] = {
            i: row.failure for i, row in enumerate(rows) if row.failure is not None
        }
        todo = [i for i, row in enumerate(rows) if row.request is not None]
        for attempt in range(1, CALL_ATTEMPTS + 1):
            if not todo:
                break
            sent = client.verify_batch(
                self.connection.target,
                [rows[i].request for i in todo],
                timeout=self.batch_timeout,
                connect_timeout=self.connect_timeout,
                security=self.security,
                connection=self.connection,
            )
            again: list[int] = []
            failure: Failure | None = None
            for i, outcome in zip(todo, sent, strict=True):
                if isinstance(outcome, Failure) and outcome.whole_call:
                    again.append(i)
                    failure = outcome
                else:
                    outcomes[i] = outcome
            todo = again
            if failure is None:
                break
            if self.stop.is_set() or self.connection.closed:
                raise _Stopped
            if failure.code not in RETRYABLE_CALL_CODES or attempt == CALL_ATTEMPTS:
                raise CallFailed(
                    f"a call to the bridge at {self.connection.target} failed as a whole "
                    f"({attempt} attempt{'s' if attempt > 1 else ''}): {failure.cause}: "
                    f"{failure.message}"
                )
            log.warning(
                "call failed as a whole (%s); retrying its %d rows", failure.cause, len(todo)
            )
            if self.stop.wait(attempt):  # 1 s, then 2 s
                raise _Stopped
        return [scorefile.record(row, outcomes[i]) for i, row in enumerate(rows)]

    def run(self, rows: Iterator[scorefile.Row], batch_size: int, out, on_write) -> bool:
        """Score `rows`, appending records to the binary file `out` in input order.

        `on_write(records)` is called after each flushed write. Returns True when every row
        was written, False when stopped early. Closes the connection (cancelling what is
        still in flight) before returning.

        Raises:
            CallFailed, client.ProtocolError: from a batch; OUT keeps the prefix before it.
        """
        chunks = _chunks(rows, batch_size)
        pending: dict[int, Future] = {}
        finished: dict[int, list[dict[str, Any]]] = {}
        next_submit = next_write = 0
        exhausted = False
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="score")
        try:
            while True:
                while (
                    not exhausted
                    and not self.stop.is_set()
                    and len(pending) < self.concurrency
                    and next_submit - next_write < 2 * self.concurrency
                ):
                    chunk = next(chunks, None)
                    if chunk is None:
                        exhausted = True
                        break
                    pending[next_submit] = pool.submit(self.score_chunk, chunk)
                    next_submit += 1
                stopping = self.stop.is_set()
                for index, future in list(pending.items()):
                    if future.done():
                        del pending[index]
                        try:
                            finished[index] = future.result()
                        except _Stopped:
                            stopping = True
                while next_write in finished:
                    records = finished.pop(next_write)
                    out.write(b"".join(scorefile.dumps(r) for r in records))
                    out.flush()
                    self.written += len(records)
                    on_write(records)
                    next_write += 1
                if stopping:
                    return False
                if exhausted and not pending:
                    return True
                wait(list(pending.values()), timeout=0.25, return_when=FIRST_COMPLETED)
        finally:
            self.connection.close()  # cancels whatever is still in flight
            pool.shutdown(wait=True, cancel_futures=True)


def _install_stop_handlers(stop: threading.Event) -> dict[int, Any]:
    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print(
            f"\n{signal.Signals(signum).name}: stopping; rows scored so far are kept "
            "(Ctrl-C again to abort now)",
            file=sys.stderr,
        )

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    return previous


def _output_problem(path: Path) -> str | None:
    """Why OUT cannot be appended to, or None; checked before anything is scored."""
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
    """Run `score` with parsed `args` (see `add_score_command`). Returns the exit status:
    0 done (per-row failures included), 1 an error (bad input/OUT, no bridge, a call that
    kept failing), 2 an OUT that cannot be written, 130 stopped by SIGINT/SIGTERM (rerun
    the same command to resume)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    problem = _output_problem(args.output)
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
    summary = start.summary
    status = 0
    if start.done < start.total:
        try:
            status = _score_rest(args, start)
        except KeyboardInterrupt:  # a second Ctrl-C
            print("aborted", file=sys.stderr)
            status = EXIT_INTERRUPTED
    print(summary.table())
    print(f"{summary.rows} of {start.total} rows in {args.output} ({summary.failed} failed)")
    return status


def _score_rest(args: argparse.Namespace, start: scorefile.Plan) -> int:
    stop = threading.Event()
    previous = _install_stop_handlers(stop)
    try:
        target = None if args.head_url else (args.target or settings.target())
        try:
            security = channels.Security.from_env(tls=target is not None)
            batch_timeout = settings.batch_timeout()
            if args.batch_timeout is not None:
                batch_timeout = args.batch_timeout
            connect_timeout = settings.connect_timeout()
            if target is None:
                head_url = (args.head_url or settings.head_url()).rstrip("/")
                target = embedded.ensure_bridge(embedded.BridgeSpec(head_url=head_url))
        except (ValueError, RuntimeError) as exc:
            print(f"nemo-gym-grpc score: {exc}", file=sys.stderr)
            return 1
        connection = channels.Connection(target, security)
        try:
            return _score_through(connection, args, start, stop, batch_timeout, connect_timeout)
        finally:
            connection.release()  # this process exits soon: see Connection.release
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _score_through(
    connection: channels.Connection,
    args: argparse.Namespace,
    start: scorefile.Plan,
    stop: threading.Event,
    batch_timeout: float,
    connect_timeout: float,
) -> int:
    from tqdm import tqdm  # only the score command needs it

    if not connection.wait_ready(connect_timeout):
        if stop.is_set():
            return EXIT_INTERRUPTED
        print(
            f"nemo-gym-grpc score: no connection to the bridge at {connection.target} within "
            f"{connect_timeout:g} s ({settings.CONNECT_TIMEOUT_ENV})",
            file=sys.stderr,
        )
        return 1
    print(
        f"scoring {start.total - start.done} rows of {args.rows} through the bridge at "
        f"{connection.target} ({start.done} already in {args.output})",
        file=sys.stderr,
    )
    scorer = FileScorer(
        connection,
        connection.security,
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

    def on_write(records: list[dict[str, Any]]) -> None:
        for rec in records:
            start.summary.add(rec)
        bar.update(len(records))
        bar.set_postfix(failed=start.summary.failed, refresh=False)

    try:
        with open(args.output, "ab") as out:
            complete = scorer.run(rows, args.batch_size, out, on_write)
    except (CallFailed, client.ProtocolError, OSError) as exc:
        bar.close()
        print(
            f"nemo-gym-grpc score: stopped: {exc}\n{start.summary.rows} rows are in "
            f"{args.output}; rerun the same command to continue",
            file=sys.stderr,
        )
        return 1
    bar.close()
    if not complete:
        print(
            f"interrupted: {scorer.written} rows scored in this run are kept in "
            f"{args.output}; rerun the same command to score the rest",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    return 0
