"""What a large head-server config costs calls in flight when callers keep naming servers the
bridge does not know (each makes it read the config again): the latency of one client's unary
`Verify` to a known server while another names an unknown server every 0.5 s.

    python -m benchmarks.head_stall                  # this checkout's bridge
    python -m benchmarks.head_stall --code OTHER     # another checkout (e.g. a `git worktree`)

The head server and the upstream are scripted (tests/support/canned_http.py, in this process):
the config is `--servers` servers with 600 settings each, as NeMo Gym's configs carry their
servers' settings (about 0.9 MB at the default), the upstream answers every `/verify` with a
reward at once. Prints the known server's Verify latency (p50, p99, max, ms) and how often the
head server was read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc
import yaml

from nemo_gym_grpc.shared.child import Child, bridge_command
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support.canned_http import CannedServer, canned

CONFIG_PATH = "GET /global_config_dict_yaml"


def config(servers: int) -> bytes:
    """A head server's reply listing `servers` resources servers, each with its settings."""
    settings = {f"option_{k}": {"value": k, "text": "x" * 20} for k in range(600)}
    entries = {
        f"server_{n}": {
            "resources_servers": {f"type_{n}": {"host": "127.0.0.1", "port": 1, **settings}}
        }
        for n in range(servers)
    }
    text = json.dumps(yaml.safe_dump(entries)).encode()
    return canned(200, text, Content_Type="application/json")


def unknown_names(target: str, stop: threading.Event) -> int:
    """Name an unknown server every 0.5 s until `stop`; returns how many were sent."""
    sent = 0
    with grpc.insecure_channel(target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        while not stop.wait(0.5):
            name = f"nope{sent}"
            request = verify_pb2.VerifyRequest(request_id=name, resources_server=name)
            stub.Verify(request, timeout=60)
            sent += 1
    return sent


def latencies(target: str, seconds: float) -> list[float]:
    """Unary Verify calls to the known server, one after another, for `seconds`: their
    latencies in ms."""
    took: list[float] = []
    with grpc.insecure_channel(target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        request = verify_pb2.VerifyRequest(request_id="k", resources_server="known", completion="B")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            started = time.monotonic()
            stub.Verify(request, timeout=60)
            took.append((time.monotonic() - started) * 1000)
    return took


def run(env: dict[str, str], servers: int, seconds: float) -> dict:
    body = config(servers)
    with CannedServer("127.0.0.4") as head, CannedServer("127.0.0.5") as upstream:
        head.answer(CONFIG_PATH, body)
        upstream.answer("POST /verify", canned(200, b'{"reward": 1.0}'))
        command = bridge_command(
            "--listen", "127.0.0.1:0", "--head-url", head.url, "--server", f"known={upstream.url}"
        )
        child = Child(command, env={**os.environ, **env})
        try:
            target = child.wait_ready(120)
            latencies(target, 2.0)  # warm up
            reads_before = head.seen.count(CONFIG_PATH)
            stop = threading.Event()
            naming = threading.Thread(target=unknown_names, args=(target, stop), daemon=True)
            naming.start()
            took = latencies(target, seconds)
            stop.set()
            naming.join(60)
        finally:
            child.stop(10.0)
    took.sort()
    return {
        "config_mb": round(len(body) / 1e6, 2),
        "calls": len(took),
        "p50_ms": round(statistics.median(took), 1),
        "p99_ms": round(took[int(len(took) * 0.99)], 1),
        "max_ms": round(took[-1], 1),
        "config_reads": head.seen.count(CONFIG_PATH) - reads_before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", type=Path, help="a checkout to run the bridge from")
    parser.add_argument("--servers", type=int, default=55, help="servers in the config")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds measured")
    args = parser.parse_args()
    env = {}
    if args.code:
        from tests.support.layout import laid_out_elsewhere

        env["PYTHONPATH"] = str(laid_out_elsewhere(args.code))
    print(json.dumps(run(env, args.servers, args.seconds)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
