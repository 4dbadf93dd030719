"""Thousands of concurrent NeMo Gym sessions from one client (issue 30): every session opened at
once through one `AsyncSessionClient` (one gRPC channel: one connection to the bridge), each
one's tool called and verified in it, then closed.

    .venv/bin/python -m benchmarks.sessions_scale [--sessions 1000,4000,16000] [--out DIR]

(from the repository root; DIR defaults to benchmarks/results; 16,000 is the bridge's
--max-sessions default). It starts NeMo Gym's example_session_state_mgmt (NeMo Gym 0.7.0
unless NEMO_GYM_VERSION says otherwise: one uvicorn process, a counter per session kept in its
cookie) and one bridge with its defaults. Per count: seconds from the first open to the last
close, sessions/s, the most sessions the bridge held open at once (its
`nemo_gym_grpc_open_sessions` gauge, scraped every 50 ms), failures (each must be none: every
session's verify must find its own counter), the bridge's peak RSS, and its TCP connections
(to the client; to the server) at their peak. Results go to --out (sessions_scale.json, .md).
Every server is stopped by its recorded PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.tables import write_rows
from nemo_gym_grpc.rewards.client.sessions import AsyncSessionClient, SessionError
from tests.support import NemoGymServers, start_bridge
from tests.support.prometheus_scrape import metrics_url, scrape, value

SERVER = "example_session_state_mgmt"
PARAMS = {"input": [{"role": "user", "content": "Count, then say the count."}]}


async def one_session(client: AsyncSessionClient, k: int) -> str | None:
    """Open, increment by `k % 7`, verify the count, close; None, or what failed."""
    start, add = k % 5, k % 7
    row = {"responses_create_params": PARAMS, "initial_count": start, "expected_count": start + add}
    try:
        async with await client.open(SERVER, row, timeout=600) as session:
            await session.call_tool("increment_counter", {"count": add}, timeout=600)
            result = await session.verify(completion=str(start + add), row=row, timeout=600)
    except SessionError as exc:
        return exc.failure.cause
    return None if result.reward == 1.0 else f"reward {result.reward}"


class Watch:
    """Samples, every 50 ms until stopped: the bridge's open-session gauge and its TCP
    connections to `bridge_port` (from clients) and to `server_port` (to the server)."""

    def __init__(self, bridge: Any, bridge_port: int, server_port: int) -> None:
        self.proc = psutil.Process(bridge.pid)
        self.url = metrics_url(bridge)
        self.ports = (bridge_port, server_port)
        self.peaks = {"open_sessions": 0.0, "client_connections": 0, "server_connections": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            opened = value(scrape(self.url), "nemo_gym_grpc_open_sessions")
            conns = self.proc.net_connections(kind="tcp")
            inbound = sum(1 for c in conns if c.laddr and c.laddr.port == self.ports[0])
            outbound = sum(1 for c in conns if c.raddr and c.raddr.port == self.ports[1])
            for key, seen in zip(self.peaks, (opened, inbound - 1, outbound), strict=True):
                self.peaks[key] = max(self.peaks[key], seen)  # inbound less the listener

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_count(bridge: Any, server_port: int, count: int) -> dict[str, Any]:
    """One count's row (module docstring)."""
    port = int(bridge.target.rsplit(":", 1)[1])

    async def all_at_once() -> list[str | None]:
        async with AsyncSessionClient(bridge.target, timeout=600) as client:
            return await asyncio.gather(*(one_session(client, k) for k in range(count)))

    with Watch(bridge, port, server_port) as watch:
        started = time.perf_counter()
        failures = [f for f in asyncio.run(all_at_once()) if f]
        seconds = time.perf_counter() - started
    return {
        "sessions": count,
        "seconds": round(seconds, 2),
        "sessions_per_s": round(count / seconds, 1),
        "peak_open_sessions": int(watch.peaks["open_sessions"]),
        "failures": len(failures),
        "failure_causes": sorted(set(failures))[:5],
        "bridge_peak_rss_mb": round(psutil.Process(bridge.pid).memory_info().rss / 2**20, 1),
        "client_connections": watch.peaks["client_connections"],
        "server_connections": watch.peaks["server_connections"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", default="1000,4000,16000")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    rows = []
    with NemoGymServers((SERVER,)) as gym:
        server_port = int(gym.server_urls[SERVER].rsplit(":", 1)[1])
        with start_bridge("--head-url", gym.head_url, "--metrics-port", "0") as bridge:
            for count in (int(n) for n in args.sessions.split(",")):
                rows.append(run_count(bridge, server_port, count))
                print(json.dumps(rows[-1]), flush=True)
    print(write_rows(args.out, "sessions_scale", rows), end="")


if __name__ == "__main__":
    main()
