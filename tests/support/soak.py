"""Endurance soak: items through the reward functions and raw VerifyStreams, under chaos.

    python -m tests.support.soak --duration 600 --out benchmarks/results   # `make soak`
    summary = run_soak(SoakConfig(duration=60), tmp_path)                   # tests/test_soak.py

Everything is real: NeMo Gym's mcqa resources server (`ng_run`), the bridge process, gRPC over
loopback, `create_nemo_gym_reward_fn`. While clients keep items flowing, a chaos driver
  (a) SIGKILLs the mcqa server process every `kill_every` s and starts it again at once with
      its own command line, working dir and environment (ng_run and its head server stay up);
  (b) SIGTERMs the bridge once, at `bridge_restart_at` of the run, and starts a new one on the
      same port (the clients' channels reconnect; items of calls that failed as a whole are
      sent again);
  (c) cancels `cancel_fraction` of the raw streams after their first results;
  (d) makes `bad_fraction` of the items bad (unparsable row, unknown resources server, empty
      resources server name).
Besides the raw streams and the reward functions, `slow_readers` workers send items with a
`large_reply_bytes` completion and `include_reply` (mcqa echoes the response, so each result
holds a reply that large) and read each response message `slow_read_pause` s late: results
pile up in the bridge, which must keep them within its byte limits and lose none.
Every item is a logical id with a known answer (mcqa's first example row, the right or a
wrong letter boxed), so the ledger (soak_ledger.py) can count what matters: items lost,
results duplicated or misassigned, a silent 0.0 for an item that failed, untyped failures.
The bridge's RSS and open file descriptors are sampled every second; soak_report.py checks
the numbers, writes the JSON summary and (with --plot) a PNG over time.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

from nemo_gym_grpc.rewards import create_nemo_gym_reward_fn
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import soak_chaos, soak_report
from tests.support.bridge import start_bridge
from tests.support.items import mcqa_item, mcqa_row, wrong_letter
from tests.support.soak_ledger import BAD, RIGHT, WRONG, Ledger
from tests.support.stack import NemoGymServers

CALL_DEADLINE = 60.0  # seconds, gRPC deadline of one client call
DRAIN_LIMIT = 120.0  # seconds after the run for calls in flight and resends to finish


@dataclass
class SoakConfig:
    """What the soak runs. Times in seconds; fractions 0..1."""

    duration: float = 600.0
    kill_every: float = 30.0
    bridge_restart_at: float = 0.5  # fraction of `duration`
    cancel_fraction: float = 0.01
    bad_fraction: float = 0.01
    stream_workers: int = 2
    reward_workers: int = 2
    stream_batch: int = 256
    reward_batch: int = 64
    warmup: float = 60.0  # seconds after each bridge start before its RSS / fd baseline
    min_items: int = 200_000
    max_rss_growth: float = 0.10
    max_fd_growth: int = 16
    version: str | None = None  # NeMo Gym version; None = env NEMO_GYM_VERSION / 0.7.0
    seed: int = 0
    replicas: int = 2  # mcqa instances behind the one routing name; one is killed at a time
    slow_readers: int = 1
    slow_batch: int = 32
    large_reply_bytes: int = 256 * 1024
    slow_read_pause: float = 0.05


def _stream_item(item_id: str, kind: str, bad_choice: int) -> verify_pb2.VerifyRequest:
    if kind == RIGHT:
        return mcqa_item(item_id, answer=True)
    if kind == WRONG:
        return mcqa_item(item_id, answer=False)
    if bad_choice == 0:
        return mcqa_item(item_id, row_json="{not json")
    return mcqa_item(item_id, resources_server="no_such_server")


def _large(item: verify_pb2.VerifyRequest, size: int) -> verify_pb2.VerifyRequest:
    """`item` with its completion padded to about `size` bytes and its reply asked for."""
    item.completion = "x" * size + " " + item.completion
    item.include_reply = True
    return item


def _stream_worker(
    worker: int,
    config: SoakConfig,
    ledger: Ledger,
    target: str,
    stop: threading.Event,
    slow: bool = False,
) -> None:
    """Raw VerifyStream calls: new ids plus this worker's resends, one call per batch; `slow`:
    large replies read late (see the module docstring)."""
    rng = random.Random(config.seed * 1000 + worker + (700 if slow else 0))
    options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    channel = grpc.insecure_channel(target, options=options)
    stub = verify_pb2_grpc.VerifyServiceStub(channel)
    prefix = f"L{worker}-" if slow else f"s{worker}-"
    batch = config.slow_batch if slow else config.stream_batch
    try:
        while ledger.keep_going(prefix, stop):
            ids = ledger.take(prefix, batch, rng, config.bad_fraction, stop)
            items = [_stream_item(i, ledger.kind(i), rng.randrange(2)) for i in ids]
            if slow:
                items = [_large(item, config.large_reply_bytes) for item in items]
            cancel = rng.random() < config.cancel_fraction
            batches = [
                verify_pb2.VerifyStreamRequest(items=items[k : k + 64])
                for k in range(0, len(items), 64)
            ]
            got: dict[str, verify_pb2.VerifyResponse] = {}
            whole_call = False
            call = stub.VerifyStream(iter(batches), timeout=CALL_DEADLINE, wait_for_ready=True)
            try:
                for message in call:
                    for result in message.results:
                        ledger.check_new_result(result.request_id, set(ids), got)
                        got[result.request_id] = result
                    if cancel and got:
                        call.cancel()
                    if slow:
                        time.sleep(config.slow_read_pause)
            except grpc.RpcError:
                whole_call = True
            if cancel:
                ledger.count("streams_cancelled")
            for item_id, result in got.items():
                ledger.resolve_result(item_id, result)
            ledger.unanswered(prefix, [i for i in ids if i not in got], whole_call)
    finally:
        channel.close()


def _reward_worker(
    worker: int, config: SoakConfig, ledger: Ledger, target: str, stop: threading.Event
) -> None:
    """`create_nemo_gym_reward_fn` calls (as TRL makes them), failures as None, causes read
    from its `log_extra` error column."""
    rng = random.Random(config.seed * 1000 + 500 + worker)
    row = mcqa_row()
    expected = str(row["expected_answer"])
    fn = create_nemo_gym_reward_fn(
        None,
        {"mcqa": "http://unused.invalid/verify"},  # only for an embedded bridge; not used
        target=target,
        on_error="none",
        max_failure_fraction=1.0,
        batch_timeout=CALL_DEADLINE,
    )
    prefix = f"r{worker}-"
    while ledger.keep_going(prefix, stop):
        ids = ledger.take(prefix, config.reward_batch, rng, config.bad_fraction, stop)
        kinds = [ledger.kind(i) for i in ids]
        letters = [wrong_letter(expected) if k == WRONG else expected for k in kinds]
        completions = [f"Let me think. \\boxed{{{letter}}}" for letter in letters]
        refs = [{"name": "" if k == BAD else "mcqa"} for k in kinds]
        columns: dict[str, list[Any]] = {}

        def log_extra(column: str, values: list[Any], columns: dict = columns) -> None:
            columns[column] = list(values)

        try:
            rewards = fn(
                completions,
                resources_server_ref=refs,
                verify_extra=[row] * len(ids),
                log_extra=log_extra,
                log_metric=lambda name, value: None,
            )
        except Exception as exc:  # noqa: BLE001 - any raise is a soak failure, counted
            ledger.count("reward_fn_raised")
            ledger.note(f"reward function raised {type(exc).__name__}: {exc}"[:300])
            ledger.unanswered(prefix, ids, whole_call=True)
            continue
        causes = columns.get("nemo_gym/error", [None] * len(ids))
        ledger.resolve_rewards(prefix, ids, rewards, causes)


def _drain_wait(threads: list[threading.Thread], limit: float) -> None:
    deadline = time.monotonic() + limit
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _workers(
    config: SoakConfig, ledger: Ledger, target: str, stop: threading.Event
) -> list[threading.Thread]:
    """The client threads (not started): raw streams, reward functions, slow readers."""
    streams = [
        threading.Thread(target=_stream_worker, args=(w, config, ledger, target, stop))
        for w in range(config.stream_workers)
    ]
    rewards = [
        threading.Thread(target=_reward_worker, args=(w, config, ledger, target, stop))
        for w in range(config.reward_workers)
    ]
    slow = [
        threading.Thread(target=_stream_worker, args=(w, config, ledger, target, stop, True))
        for w in range(config.slow_readers)
    ]
    return streams + rewards + slow


def run_soak(config: SoakConfig, out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the soak; returns the summary (soak_report.summarize): counts, checks, series. The
    restarted servers' log goes into the folder `out` (made if missing)."""
    replicas = {
        f"mcqa_{k}": {"resources_servers": {"mcqa": {}}} for k in range(2, config.replicas + 1)
    }
    with NemoGymServers(("mcqa",), version=config.version, extra_config=replicas) as gym:
        servers = soak_chaos.servers(gym)
        args: tuple[str, ...] = ()
        for server in servers:  # replicas of one routing name, balanced by the bridge
            args += ("--server", f"mcqa={server.url}")
        bridge = start_bridge(*args)
        port = int(bridge.target.rsplit(":", 1)[1])
        out.mkdir(parents=True, exist_ok=True)
        chaos = soak_chaos.Chaos(bridge, port, args, servers, out / "restarted_servers.log")
        chaos.bridge_starts.append(0.0)
        ledger = Ledger()
        stop = threading.Event()
        halt = threading.Event()  # monitor and chaos
        started = time.monotonic()
        log(f"soak: NeMo Gym {gym.version}, bridge {bridge.target}, {config.duration:.0f} s")
        workers = _workers(config, ledger, bridge.target, stop)
        helpers = [
            threading.Thread(target=soak_chaos.monitor_loop, args=(ledger, chaos, started, halt)),
            threading.Thread(target=soak_chaos.chaos_loop, args=(config, chaos, started, halt)),
        ]
        for thread in [*workers, *helpers]:
            thread.daemon = True
            thread.start()
        try:
            while time.monotonic() - started < config.duration:
                time.sleep(min(10.0, config.duration))
                log(f"soak: {ledger.progress(time.monotonic() - started)}")
            stop.set()
            _drain_wait(workers, DRAIN_LIMIT)
            last = soak_chaos.sample(f"/proc/{chaos.bridge.pid}")
            ledger.sample(time.monotonic() - started, chaos.bridge.pid, last)
        finally:
            stop.set()
            halt.set()
            for thread in helpers:
                thread.join(90)
            chaos.stop()
        if chaos.log.exists():
            log(f"soak: the restarted servers' log is {chaos.log}")
        return soak_report.summarize(
            asdict(config),
            ledger,
            events=chaos.events,
            bridge_starts=chaos.bridge_starts,
            seconds=time.monotonic() - started,
            stragglers=[t.name for t in workers if t.is_alive()],
        )


def main(argv: list[str] | None = None) -> int:
    """`make soak`: run, print the checks, write soak.json (and soak.png); 1 if a check fails."""
    parser = argparse.ArgumentParser(prog="python -m tests.support.soak", description=__doc__)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--min-items", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--plot", action="store_true", help="also write soak.png (matplotlib)")
    args = parser.parse_args(argv)
    # the reward functions warn once per call with a failed item: thousands of lines here
    logging.getLogger("nemo_gym_grpc").setLevel(logging.ERROR)
    config = SoakConfig(duration=args.duration)
    if args.min_items is not None:
        config.min_items = args.min_items
    summary = run_soak(config, args.out)
    (args.out / "soak.json").write_text(json.dumps(summary, indent=1) + "\n")
    if args.plot:
        soak_report.plot(summary, args.out / "soak.png")
    print(soak_report.render(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
