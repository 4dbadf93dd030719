"""Scenario 7 (issue 37): a server whose latency steps from 10 ms to 500 ms and back mid-run,
and how soon the bridge's adaptive limit for it follows each step.

    python -m benchmarks.latency_step [--phase 15] [--in-flight 2048]

A scripted upstream (benchmarks/upstream.py; its latency set with `PUT /latency`) behind a
bridge with its defaults and a metrics port; one client keeps `in_flight` items in flight on
one VerifyStream through three phases of `phase` seconds (10 ms, 500 ms, 10 ms), while the
bridge's `nemo_gym_grpc_upstream_limit` is read every 0.1 s. Per phase: the seconds from its
step to the first reading from which at least 90% are within a factor of 2 of the phase's
last reading (`settled_s`), the share of those that are (`held`), and that last reading.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from collections.abc import AsyncIterator

import grpc

from benchmarks import procs
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import start_bridge
from tests.support.prometheus_scrape import metrics_url, scrape, value

LATENCIES = (0.010, 0.500, 0.010)


def read_limit(url: str) -> float:
    """The bridge's upstream limit gauge at metrics `url` (0 before the first call)."""
    return value(scrape(url), "nemo_gym_grpc_upstream_limit")


def set_latency(upstream_url: str, seconds: float) -> None:
    """`PUT /latency` on the scripted upstream."""
    request = urllib.request.Request(
        f"{upstream_url}/latency", data=str(seconds).encode(), method="PUT"
    )
    with urllib.request.urlopen(request, timeout=5):
        pass


async def drive(target: str, in_flight: int, seconds: float) -> tuple[int, int]:
    """Keep `in_flight` items in flight on one VerifyStream for `seconds`; (results, failed)."""
    free = asyncio.Semaphore(in_flight)
    done = failed = 0
    end = time.monotonic() + seconds

    async def requests() -> AsyncIterator[verify_pb2.VerifyStreamRequest]:
        count = 0
        while time.monotonic() < end:
            await free.acquire()
            count += 1
            item = verify_pb2.VerifyRequest(
                request_id=f"s{count}", resources_server="gym", completion="c"
            )
            yield verify_pb2.VerifyStreamRequest(items=[item])

    async with grpc.aio.insecure_channel(target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        async for message in stub.VerifyStream(requests(), timeout=seconds + 120):
            for result in message.results:
                done += 1
                failed += result.HasField("error")
                free.release()
    return done, failed


def settled(readings: list[tuple[float, float]], start: float, end: float) -> tuple[float, float]:
    """Of the readings in [start, end): the seconds from `start` to the first one from which
    at least 90% are within a factor of 2 of the phase's last (the limit has settled, brief
    swings aside), and the share of those that are."""
    phase = [(t, v) for t, v in readings if start <= t < end]
    last = phase[-1][1]
    inside = [last / 2 <= v <= last * 2 for _, v in phase]
    for first in range(len(phase)):
        rest = inside[first:]
        if sum(rest) >= 0.9 * len(rest):
            return round(phase[first][0] - start, 2), round(sum(rest) / len(rest), 3)
    return round(end - start, 2), 0.0


def latency_step(phase: float, in_flight: int) -> dict:
    """Run the three phases; per step the seconds to settle and the phase's last limit."""
    with procs.Upstream(LATENCIES[0]) as upstream:
        args = ("--server", f"gym={upstream.url}", "--metrics-port", "0")
        with start_bridge(*args) as bridge:
            url = metrics_url(bridge)
            readings: list[tuple[float, float]] = []
            started = time.monotonic()

            async def run() -> tuple[int, int]:
                driving = asyncio.ensure_future(drive(bridge.target, in_flight, 3 * phase))
                loop = asyncio.get_running_loop()
                for index, latency in enumerate(LATENCIES):
                    await loop.run_in_executor(None, set_latency, upstream.url, latency)
                    phase_end = started + (index + 1) * phase
                    while time.monotonic() < phase_end:
                        value = await loop.run_in_executor(None, read_limit, url)
                        readings.append((time.monotonic() - started, value))
                        await asyncio.sleep(0.1)
                return await driving

            try:
                done, failed = asyncio.run(run())
            except BaseException:
                print(bridge.stderr_tail(), file=sys.stderr)
                raise
    steps = []
    for index, latency in enumerate(LATENCIES):
        start, end = index * phase, (index + 1) * phase
        last = [v for t, v in readings if start <= t < end][-1]
        after, held = settled(readings, start, end)
        steps.append({"latency_s": latency, "settled_s": after, "held": held, "limit": last})
    return {"phase_s": phase, "in_flight": in_flight, "results": done, "failed": failed,
            "steps": steps, "readings": [[round(t, 2), v] for t, v in readings]}  # fmt: skip


def scenario(s, rows: list[dict], log) -> dict:
    """`make bench` scenario 7 (`s` and `rows` unused: its sizes are fixed)."""
    log("scenario 7: upstream latency 10 ms -> 500 ms -> 10 ms, 2,048 items in flight")
    result = latency_step(15.0, 2048)
    for step in result["steps"]:
        log(f"  {step['latency_s'] * 1000:.0f} ms: settled at {step['limit']:.0f} after "
            f"{step['settled_s']} s, held {step['held']:.0%} of the rest")  # fmt: skip
    return result


def markdown_lines(scenario: dict) -> list[str]:
    """Scenario 7's line for the report."""
    steps = "; ".join(
        f"{s['latency_s'] * 1000:.0f} ms: {s['limit']:.0f} after {s['settled_s']} s, held "
        f"{s['held']:.0%}"
        for s in scenario["steps"]
    )
    return ["", f"**7. Latency step**, the adaptive limit after each step: {steps}."]


def main() -> int:
    """The command line of the module docstring; prints the steps as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", type=float, default=15.0, help="seconds per phase")
    parser.add_argument("--in-flight", type=int, default=2048)
    args = parser.parse_args()
    result = latency_step(args.phase, args.in_flight)
    print(json.dumps({k: v for k, v in result.items() if k != "readings"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
