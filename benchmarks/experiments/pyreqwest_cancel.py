"""Does cancelling the asyncio task that awaits a pyreqwest request close its upstream
connection? (Why pyreqwest does not carry the bridge's POSTs: docs/performance.md.)

    python -m pip install pyreqwest==0.15.1 && python benchmarks/experiments/pyreqwest_cancel.py

A loopback server reads one POST and holds it; the client's task is cancelled 0.3 s later;
the server records when the client closes the connection. pyreqwest 0.15.1 (measured
2026-12-01): the connection closes only at the request's own 3 s timeout (2.7 s after the
cancel), for `send()` and `build_streamed()` alike: `RuntimeHandle.spawn_handled` returns on
cancellation but drops the Tokio `JoinHandle`, which detaches the request task instead of
aborting it (rerun 2026-12-01 for issue 22: 2.70 s). aiohttp and the bridge's own plain_http
close the connection at once (the bridge's cancel tests check that).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta

from pyreqwest.client import Client, ClientBuilder

REQUEST_TIMEOUT = 3.0
closed_at: dict[str, float] = {}
closed = {"/consumed": asyncio.Event(), "/streamed": asyncio.Event()}


async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    path = head.split()[1].decode()
    await reader.readexactly(2)  # the body, b"{}"
    await reader.read(1)  # b"" once the client closes
    closed_at[path] = time.monotonic()
    closed[path].set()
    writer.close()


async def main() -> None:
    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client: Client = ClientBuilder().build()
    timeout = timedelta(seconds=REQUEST_TIMEOUT)

    async def consumed(path: str) -> None:
        reply = await client.post(base + path).body_bytes(b"{}").timeout(timeout).build().send()
        await reply.bytes()

    async def streamed(path: str) -> None:
        request = client.post(base + path).body_bytes(b"{}").timeout(timeout)
        async with request.build_streamed() as reply:
            await reply.bytes()

    ways: list[tuple[str, Callable[[str], Awaitable[None]]]] = [
        ("/consumed", consumed),
        ("/streamed", streamed),
    ]
    for path, way in ways:
        task = asyncio.ensure_future(way(path))
        await asyncio.sleep(0.3)
        cancelled = time.monotonic()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        try:
            await asyncio.wait_for(closed[path].wait(), 2 * REQUEST_TIMEOUT)
        except TimeoutError:
            pass
        after = closed_at.get(path)
        print(
            f"{path}: connection closed "
            + (f"{after - cancelled:.2f} s after the cancel" if after else "not at all")
            + f" (request timeout {REQUEST_TIMEOUT:.0f} s)"
        )
    await client.close()
    server.close()


if __name__ == "__main__":
    asyncio.run(main())
