"""The ways to carry the bridge's hot-path POST, side by side in one run (issue 22): client CPU
per request at capacity (rotated rounds, ratios to aiohttp within each round), what a cancel
does to the upstream connection, connection reuse at 16,384 in flight, and whether "refused"
can be told from "sent, then dropped".

    .venv/bin/pip install pyreqwest==0.15.1 pyqwest==0.12.0 niquests==3.21.2
    .venv/bin/python -m benchmarks.experiments.http_clients --rounds 5 \
        --out benchmarks/results/experiments/http_clients.json

Every measurement runs in a fresh child process (uvloop) per way, against
benchmarks/upstream.py (zero latency) or a loopback server of this script; every server is
started and stopped by PID. Ways: aiohttp as the direct fan-out uses it (`aiohttp`), aiohttp
trimmed to what the bridge needs (`aiohttp-trim`: no cookie jar, no decompression, no default
headers, unlimited pool, exact timeout), pyreqwest, pyqwest, niquests, and the bridge's own
`plain_http` (`plain`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

WAYS = ["aiohttp", "aiohttp-trim", "pyreqwest", "pyqwest", "niquests", "plain"]
BODY = b'{"responses_create_params": {"input": "' + b"q" * 2900 + b'"}, "response": {}}'
HEADERS = {"Content-Type": "application/json", "X-Request-Id": "item-0"}


class Way:
    """One client behind `post(url, timeout) -> (status, body)`; `kind(exc)` names a failure
    ("refused" when the class says nothing was sent, else its class name)."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def open(self) -> None:
        name = self.name
        if name.startswith("aiohttp"):
            import aiohttp

            self.aiohttp = aiohttp
            if name == "aiohttp":
                self.session = aiohttp.ClientSession()
            else:
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=15),
                    cookie_jar=aiohttp.DummyCookieJar(),
                    auto_decompress=False,
                    skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
                )
        elif name == "pyreqwest":
            from pyreqwest.client import ClientBuilder

            self.client = ClientBuilder().follow_redirects(False).build()
        elif name == "pyqwest":
            import pyqwest

            self.client = pyqwest.Client()
        elif name == "niquests":
            import niquests

            self.client = niquests.AsyncSession(pool_maxsize=256)
        else:
            from nemo_gym_grpc.bridge.nemo_gym import plain_http

            self.client = plain_http.Client(1 << 30)

    async def post(self, url: str, timeout: float) -> tuple[int, bytes]:
        name = self.name
        if name.startswith("aiohttp"):
            limit = self.aiohttp.ClientTimeout(total=timeout, ceil_threshold=math.inf)
            async with self.session.post(url, data=BODY, headers=HEADERS, timeout=limit) as r:
                return r.status, await r.read()
        if name == "pyreqwest":
            request = self.client.post(url).headers(HEADERS).body_bytes(BODY)
            reply = await request.timeout(timedelta(seconds=timeout)).build().send()
            return reply.status, bytes(await reply.bytes())
        if name == "pyqwest":
            async with asyncio.timeout(timeout):
                reply = await self.client.post(url, headers=HEADERS, content=BODY)
            return reply.status, reply.content
        if name == "niquests":
            reply = await self.client.post(url, data=BODY, headers=HEADERS, timeout=timeout)
            return reply.status_code, reply.content
        reply = await self.client.post(url, BODY, HEADERS.items(), timeout)
        return reply.status, reply.body

    def kind(self, exc: BaseException) -> str:
        name = self.name
        refused = {
            "aiohttp": "ClientConnectorError",
            "aiohttp-trim": "ClientConnectorError",
            "plain": "ConnectFailed",
        }.get(name)
        names = {c.__name__ for c in type(exc).__mro__}
        if refused in names or (name == "pyqwest" and isinstance(exc, ConnectionError)):
            return "refused"
        return f"{type(exc).__name__}: {str(exc)[:120]}"

    async def close(self) -> None:
        if self.name.startswith("aiohttp"):
            await self.session.close()
        elif self.name in ("plain", "niquests"):
            await self.client.close()
        elif self.name == "pyreqwest":
            await self.client.close()


# ---- child measurements (one way, one process) ----------------------------------------


async def cpu(way: Way, url: str, count: int, concurrency: int) -> dict:
    """Client CPU per request for `count` POSTs at `concurrency` (after a warm-up)."""
    url += "/verify"
    gate = asyncio.Semaphore(concurrency)
    failed = 0

    async def one() -> None:
        nonlocal failed
        async with gate:
            status, _ = await way.post(url, 10.0)
            failed += status != 200

    await asyncio.gather(*(one() for _ in range(1000)))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    cpu_s, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"cpu_us": cpu_s / count * 1e6, "rps": count / wall, "failed": failed}


async def cancel(way: Way, _url: str, *_: int) -> dict:
    """Seconds from cancelling a request held by the server to the connection closing."""
    closed = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.read(1 << 16)
        while await reader.read(1 << 16):
            pass
        closed.set()
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/verify"
    task = asyncio.ensure_future(way.post(url, 3.0))
    await asyncio.sleep(0.3)
    cancelled = time.monotonic()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001, S110 (cancelled: what is measured is the server side)
        pass
    try:
        await asyncio.wait_for(closed.wait(), 6.0)
        after = round(time.monotonic() - cancelled, 3)
    except TimeoutError:
        after = None
    server.close()
    return {"closed_after_s": after, "request_timeout_s": 3.0}


async def reuse(way: Way, url: str, count: int, _c: int) -> dict:
    """Two waves of `count` concurrent POSTs to a counting upstream (0.2 s latency): the
    connections each wave opened, and its seconds."""
    url += "/verify"
    out = {}
    for wave in (1, 2):
        before = _connections(url)
        started = time.perf_counter()
        results = await asyncio.gather(
            *(way.post(url, 60.0) for _ in range(count)), return_exceptions=True
        )
        errors = [way.kind(r) for r in results if isinstance(r, BaseException)]
        out[f"wave{wave}"] = {
            "new_connections": _connections(url) - before,
            "seconds": round(time.perf_counter() - started, 2),
            "failed": len(errors),
            "first_error": errors[0] if errors else "",
        }
    return out


def _connections(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(url.replace("/verify", "/count"), timeout=10) as reply:  # noqa: S310
        return int(reply.read())


async def refusal(way: Way, _url: str, *_: int) -> dict:
    """The failure of a POST to a closed port, and of one a server read and then dropped."""

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    dropped_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/verify"
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        closed_url = f"http://127.0.0.1:{free.getsockname()[1]}/verify"
    out = {}
    for key, url in (("closed_port", closed_url), ("sent_then_dropped", dropped_url)):
        try:
            await way.post(url, 5.0)
            out[key] = "no error"
        except Exception as exc:  # noqa: BLE001 (what is measured is the class)
            out[key] = way.kind(exc)
    server.close()
    out["told_apart_by_class"] = (
        out["closed_port"] == "refused" and out["sent_then_dropped"] != "refused"
    )
    return out


TESTS = {"cpu": cpu, "cancel": cancel, "reuse": reuse, "refusal": refusal}


def child(args: argparse.Namespace) -> None:
    import uvloop

    async def run() -> dict:
        way = Way(args.way)
        await way.open()
        try:
            return await TESTS[args.test](way, args.url, args.count, args.concurrency)
        finally:
            await way.close()

    print(json.dumps(uvloop.run(run())))


# ---- the run (orchestrator) ----------------------------------------------------------


def measure(way: str, test: str, url: str, count: int, concurrency: int = 256) -> dict:
    command = [
        sys.executable,
        "-m",
        "benchmarks.experiments.http_clients",
        "--child",
        "--way",
        way,
        "--test",
        test,
    ]
    command += ["--url", url]
    command += ["--count", str(count), "--concurrency", str(concurrency)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        return {"error": "no result within 300 s"}
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1][:200] if done.stderr else "?"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float], digits: int = 2) -> str:
    if not values:
        return "-"
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def cpu_rounds(ways: list[str], rounds: int, count: int) -> list[dict]:
    from benchmarks import procs

    out = []
    with procs.Upstream(0.0) as up:
        for index in range(rounds):
            shift = index % len(ways)
            row = {}
            for way in ways[shift:] + ways[:shift]:
                n = count // 10 if way == "niquests" else count
                row[way] = measure(way, "cpu", up.url, n)
            row["loadavg"] = os.getloadavg()[0]
            out.append(row)
            print(
                f"round {index + 1}: "
                + ", ".join(f"{w} {row[w].get('cpu_us', float('nan')):.0f} us" for w in ways)
                + f", load {row['loadavg']:.1f}",
                flush=True,
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--way", default="plain")
    parser.add_argument("--test", default="cpu")
    parser.add_argument("--url", default="")
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--in-flight", type=int, default=16384)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    from benchmarks import procs

    ways = args.ways.split(",")
    result: dict = {"cpu": cpu_rounds(ways, args.rounds, args.count), "ways": {}}
    with procs.Upstream(0.2) as slow:
        for way in ways:
            result["ways"][way] = {
                "cancel": measure(way, "cancel", "", 0),
                "refusal": measure(way, "refusal", "", 0),
                "reuse": measure(way, "reuse", slow.url, args.in_flight),
            }
            print(way, json.dumps(result["ways"][way]), flush=True)
    print(
        f"\nclient CPU per request, {args.count} POSTs at C={args.concurrency}, median (min-max):"
    )
    for way in ways:
        rows = [r for r in result["cpu"] if "cpu_us" in r[way] and "cpu_us" in r["aiohttp"]]
        cpu_us = [r[way]["cpu_us"] for r in rows]
        ratio = [r["aiohttp"]["cpu_us"] / r[way]["cpu_us"] for r in rows]
        print(f"  {way}: {spread(cpu_us, 0)} us, aiohttp / this {spread(ratio)}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
