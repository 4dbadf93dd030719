"""`nemo-gym-grpc score ROWS.jsonl -o OUT.jsonl`: re-verify saved rollouts through the bridge.

Rows (NeMo Gym dataset rows with the `response` a rollout saved; the files: `scorefile.py`) are
read lazily and scored in batches (`batches.py`) through a running bridge (`--target`, else
`NEMO_GYM_GRPC_TARGET`; TLS and token from the environment) or an embedded one (`--head-url`
to discover servers, `--server NAME=URL` to route one; `stream.Route`). Everything runs on one
asyncio event loop:

- before scoring: a bridge that refuses the connection fails the run at once (exit 1); one
  that does not answer within `NEMO_GYM_GRPC_CONNECT_TIMEOUT` too; then each server's verdict
  fields are read (`verdicts.py`), to be left out of the rows sent;
- resume: running the same command again skips the rows already in OUT (checked by line
  number and hash) and appends the rest; a last line cut short by a crash is dropped first;
- Ctrl-C (SIGINT) or SIGTERM: stop sending, keep every batch that finished in order, cancel
  the calls in flight (the bridge cancels their `/verify` calls), print the summary, exit
  130; a second Ctrl-C aborts at once (OUT is still a valid prefix);
- rows without a verdict (`batches.py`): the run stops with exit 1 and OUT keeps the rows
  before their batch, for a rerun. Per-row verdicts (a reward, or a failure of the row
  itself) are results: they are written and counted.

A progress bar (tqdm, items/s) goes to stderr; the summary table (per resources server: rows,
scored, mean reward, failures by cause) to stdout, covering all of OUT.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys

from nemo_gym_grpc.rewards.client import channels, embedded, settings
from nemo_gym_grpc.rewards.client.outcomes import ProtocolError
from nemo_gym_grpc.rewards.client.stream import Route
from nemo_gym_grpc.rewards.tools import scorefile, verdicts
from nemo_gym_grpc.rewards.tools.batches import FileScorer, NoVerdict, Record

EXIT_INTERRUPTED = 130
PROG = "nemo-gym-grpc score"


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr)


def run_score(args: argparse.Namespace) -> int:
    """Run `score` with the parsed arguments of its parser (`cli.py`): `rows`, `output`
    (Paths, OUT checked writable), `server` ((name, URL or None) or None), `target`,
    `head_url` (str or None), `batch_size`, `concurrency` (int), `timeout` (seconds, 0 = the
    bridge's), `batch_timeout` (seconds or None), `no_progress` (bool).

    Returns the exit status: 0 done (per-row verdicts included), 1 an error (bad input or
    OUT, no bridge, rows without a verdict), 130 stopped by SIGINT/SIGTERM (rerun the same
    command to resume)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        start = scorefile.plan(args.rows, args.output)
    except (OSError, scorefile.OutputMismatch) as exc:
        _say(str(exc))
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


def _route(args: argparse.Namespace) -> Route:
    """Where the calls go: `--head-url` or `--server NAME=URL` start an embedded bridge
    (whatever `NEMO_GYM_GRPC_TARGET` says); else `--target`, `NEMO_GYM_GRPC_TARGET` or an
    embedded bridge over `NEMO_GYM_HEAD_URL`. Raises ValueError for a bad variable."""
    timeout = settings.resolve(args.batch_timeout, settings.batch_timeout)
    name, url = args.server or (None, None)
    if args.head_url or url:
        spec = embedded.BridgeSpec(
            head_url=args.head_url, servers=((name, url),) if name and url else ()
        )
        return Route.to_embedded(lambda: spec, timeout)
    return Route.resolve(target=args.target, timeout=timeout)


async def _unready(route: Route, target: str, stop: asyncio.Event) -> str | None:
    """None once the bridge at `target` accepts a connection; else why not (it failed at
    once: refused, or a failed TLS handshake; or nothing within the connect timeout), or ""
    when `stop` was set first."""
    async with channels.aio_channel(target, route.security) as channel:
        ready = channels.ready(channel, route.connect_timeout, refused_fails=True)
        waits = [asyncio.ensure_future(ready), asyncio.ensure_future(stop.wait())]
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    connected = waits[0].result() if waits[0] in done else None  # None: not within the time
    if connected:
        return None
    if connected is False:
        plain = route.target and not route.security.ca  # a configured bridge, in plaintext
        hint = f"; a bridge serving TLS needs {settings.CA_ENV}" if plain else ""
        return f"cannot connect to the bridge at {target} (refused?{hint})"
    if stop.is_set():
        return ""
    return (
        f"no connection to the bridge at {target} within {route.connect_timeout:g} s "
        f"({settings.CONNECT_TIMEOUT_ENV})"
    )


async def _connect_and_score(
    args: argparse.Namespace, start: scorefile.Plan, stop: asyncio.Event
) -> int:
    """Reach the bridge, read the servers' verdict fields, score the pending rows."""
    try:
        route = _route(args)
        target = await route.aaddress()
    except (ValueError, RuntimeError) as exc:
        _say(str(exc))
        return 1
    problem = await _unready(route, target, stop)
    if problem is not None:
        if problem:
            _say(problem)
        return 1 if problem else EXIT_INTERRUPTED
    route = dataclasses.replace(route, target=target, refused_fails=True)
    found = await verdicts.read_verdicts(target, route.security)
    for name, why in found.unread.items():
        left_out = ", ".join(sorted(verdicts.BASE_VERDICT_FIELDS))
        print(f"warning: {name}: {why}; its rows are sent without {left_out}", file=sys.stderr)
    print(
        f"scoring {start.total - start.done} rows of {args.rows} through the bridge at "
        f"{target} ({start.done} already in {args.output})",
        file=sys.stderr,
    )
    scorer = FileScorer(route, concurrency=args.concurrency, stop=stop)
    return await _score_pending(args, start, scorer, found)


async def _score_pending(
    args: argparse.Namespace,
    start: scorefile.Plan,
    scorer: FileScorer,
    found: verdicts.Verdicts,
) -> int:
    """Score the rows after OUT's prefix with a progress bar; the exit status."""
    from tqdm import tqdm  # only the score command needs it

    default_server = args.server[0] if args.server else None
    rows = scorefile.pending_rows(
        args.rows, start.resume_after, default_server, args.timeout, found.of
    )
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
    except (NoVerdict, ProtocolError, OSError) as exc:
        _say(
            f"stopped: {exc}\n{start.summary.rows} rows are in {args.output}; rerun the same "
            "command to continue"
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
