"""What large replies, large items, long request_ids and open health calls cost the bridge in
memory, and how many outcomes come back: the cases of docs/operating.md's limits, each against
a fresh bridge with its defaults (and `--token-file` for the health case).

    python -m benchmarks.memory                     # this checkout's bridge
    python -m benchmarks.memory --code OTHER        # another checkout (e.g. a `git worktree`)
    python -m benchmarks.memory --case gzip_bomb    # one case

Per case: the outcomes (result reasons, or the status that ended the call), the bridge's peak
RSS (VmHWM) and its RSS once the case is over (what it keeps holding). The upstream is scripted
(tests/support/fault_proxy.py in this process): no NeMo Gym server sends these replies on
demand. Only loopback; every case is bounded in items and time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks import procs
from nemo_gym_grpc.shared.child import Child, bridge_command
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.items import reason, scoring_reply

MiB = 1024 * 1024
ROW = json.dumps({"question": "2+2?", "expected_answer": "A"})


def item(request_id: str, row_bytes: int = 0, **fields) -> verify_pb2.VerifyRequest:
    row = json.dumps({"question": "2+2?", "expected_answer": "A", "pad": "p" * row_bytes})
    return verify_pb2.VerifyRequest(
        request_id=request_id, resources_server="scripted", row_json=row, **fields
    )


def outcomes(target: str, items: list, pause: float = 0.0, per_message: int = 16) -> Counter:
    """Reasons of the results of one VerifyStream (OK for a reward), and the status that
    ended it when not OK; `pause` seconds between reading two response messages."""
    got: Counter = Counter()
    batches = [
        verify_pb2.VerifyStreamRequest(items=items[k : k + per_message])
        for k in range(0, len(items), per_message)
    ]
    options = [
        ("grpc.max_receive_message_length", 64 * MiB),
        ("grpc.max_send_message_length", 64 * MiB),
    ]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        try:
            for message in stub.VerifyStream(iter(batches), timeout=300):
                for result in message.results:
                    got[reason(result) if result.HasField("error") else "OK"] += 1
                time.sleep(pause)
        except grpc.RpcError as exc:
            got[f"call ended {exc.code().name}"] += 1
    return got


def watches(target: str) -> Counter:
    """8 health Watch calls with 32 MiB service names, held open 2 s."""
    got: Counter = Counter()
    with grpc.insecure_channel(
        target, options=[("grpc.max_send_message_length", 64 * MiB)]
    ) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        calls = [
            stub.Watch(health_pb2.HealthCheckRequest(service="s" * (32 * MiB)), timeout=60)
            for _ in range(8)
        ]
        time.sleep(2.0)
        for call in calls:
            try:
                next(call)
                got["open"] += 1
            except grpc.RpcError as exc:
                got[exc.code().name] += 1
            call.cancel()
    return got


# name -> (faults of the scripted upstream, extra bridge flags, the case's client side)
CASES: dict[str, tuple[Callable[[], list[Fault]], list[str], Callable[[str], Counter]]] = {
    "reply_200mb": (
        lambda: [Fault("status", body=scoring_reply(200 * MiB))],
        [],
        lambda target: outcomes(target, [item("one")]),
    ),
    "gzip_bomb": (
        lambda: [
            Fault(
                "status",
                body=gzip.compress(scoring_reply(512 * MiB), 9),
                headers={"Content-Encoding": "gzip"},
            )
        ],
        [],
        lambda target: outcomes(target, [item("one")]),
    ),
    "four_200mb_at_once": (
        lambda: [Fault("status", body=scoring_reply(200 * MiB))],
        [],
        lambda target: outcomes(target, [item(f"i{n}") for n in range(4)]),
    ),
    "replies_64x48mb_at_once": (
        lambda: [Fault("status", body=scoring_reply(48 * MiB))],
        [],
        lambda target: outcomes(target, [item(f"i{n}") for n in range(64)]),
    ),
    "items_300x2mb_slow_upstream": (
        lambda: [Fault("status", body=scoring_reply(200), seconds=3.0)],
        [],
        lambda target: outcomes(target, [item(f"i{n}", 2 * MiB) for n in range(300)]),
    ),
    "replies_300x512kb_slow_reader": (
        lambda: [Fault("status", body=scoring_reply(512 * 1024))],
        [],
        lambda target: outcomes(
            target, [item(f"i{n}", include_reply=True) for n in range(300)], 0.5
        ),
    ),
    "request_ids_75x4mb": (
        lambda: [Fault("status", body=scoring_reply(200))],
        [],
        lambda target: outcomes(
            target, [item(f"{n}" + "r" * (4 * MiB)) for n in range(75)], per_message=4
        ),
    ),
    "health_watch_8x32mb": (lambda: [], ["--token-file", "TOKEN"], watches),
}


def run_case(name: str, python: str, env: dict[str, str], extra: list[str]) -> dict:
    """One case against a fresh bridge (with `extra` flags): outcomes, peak and final RSS in
    MiB."""
    faults, flags, client = CASES[name]
    flags = [*flags, *extra]
    folder = Path(tempfile.mkdtemp(prefix="nemo_gym_grpc_memory_"))
    (folder / "token").write_text("s3cret\n")
    flags = [str(folder / "token") if f == "TOKEN" else f for f in flags]
    with FaultProxy(None) as upstream:
        upstream.set_faults(*faults())
        command = bridge_command(
            "--listen", "127.0.0.1:0", "--server", f"scripted={upstream.url}", *flags, python=python
        )
        child = Child(command, env={**os.environ, **env})
        try:
            target = child.wait_ready(60)
            start_mb = psutil.Process(child.pid).memory_info().rss / MiB
            got = client(target)
            time.sleep(1.0)
            return {
                "outcomes": dict(got),
                "rss_start_mb": round(start_mb),
                "peak_rss_mb": round(procs.peak_rss_mb(child.pid)),
                "rss_after_mb": round(psutil.Process(child.pid).memory_info().rss / MiB),
                "upstream_posts": upstream.total,
            }
        finally:
            child.stop(10.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--code", type=Path, help="a checkout to run the bridge from (default: this one)"
    )
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="default: all")
    parser.add_argument("--flags", default="", help="more bridge flags, e.g. '--max-stream-mb 64'")
    args = parser.parse_args()
    env = {}
    if args.code:
        from tests.support.layout import laid_out_elsewhere

        env["PYTHONPATH"] = str(laid_out_elsewhere(args.code))
    for name in args.case or CASES:
        print(name, json.dumps(run_case(name, sys.executable, env, args.flags.split())), flush=True)


if __name__ == "__main__":
    main()
