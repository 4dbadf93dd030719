"""A scripted NeMo Gym-like resources server for benchmarks: `POST /verify` answers
`{"reward": 1.0}` after a latency (`--latency`); `GET /` answers `{"status": "ok"}` (liveness);
`GET /count` the number of connections accepted so far (connection reuse, issue 22);
`PUT /latency` with a number of seconds as its body sets the latency from then on (a server
that slows down or speeds up mid-run, issue 37).

Written on plain asyncio (one `Protocol` per connection, HTTP/1.1 keep-alive, no framework),
so it costs a few tens of microseconds of CPU per request: on a 2-core machine the upstream
must not take the cores the bridge is being measured on. Thousands of concurrent connections
are fine (listen backlog up to `net.core.somaxconn`, the fd limit raised to its hard limit).

    python benchmarks/upstream.py --latency 0.02 --ready-file "$(mktemp -u)"
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import signal
from pathlib import Path

from nemo_gym_grpc.shared.child import write_ready_file

VERIFY_REPLY = b'{"reward": 1.0}'
HEALTH_REPLY = b'{"status": "ok"}'


def _response(status: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


class _Http(asyncio.Protocol):
    """One client connection: parses requests in order and answers each one."""

    accepted = 0  # connections made, over all instances
    latency = 0.0  # seconds per /verify, for all connections (`PUT /latency` sets it)

    def __init__(self) -> None:
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        _Http.accepted += 1

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (head_end := self.buffer.find(b"\r\n\r\n")) >= 0:
            request_line, *headers = self.buffer[:head_end].split(b"\r\n")
            length = 0
            for header in headers:
                name, _, value = header.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            end = head_end + 4 + length
            if len(self.buffer) < end:
                return
            body = self.buffer[head_end + 4 : end]
            self.buffer = self.buffer[end:]
            self._answer(request_line, body)

    def _answer(self, request_line: bytes, body: bytes) -> None:
        method, path = request_line.split(b" ")[:2]
        if method == b"POST" and path == b"/verify":
            reply = _response(b"200 OK", VERIFY_REPLY)
            if _Http.latency > 0:
                self.loop.call_later(_Http.latency, self._write, reply)
                return
        elif method == b"PUT" and path == b"/latency":
            _Http.latency = float(body)
            reply = _response(b"200 OK", body)
        elif method == b"GET" and path == b"/":
            reply = _response(b"200 OK", HEALTH_REPLY)
        elif method == b"GET" and path == b"/count":
            reply = _response(b"200 OK", str(_Http.accepted).encode())
        else:
            reply = _response(b"404 Not Found", b'{"detail": "Not Found"}')
        self._write(reply)

    def _write(self, reply: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


def raise_fd_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit; returns the new limit."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def somaxconn() -> int:
    """The kernel's cap on a listen backlog (net.core.somaxconn), 4096 if unreadable."""
    try:
        return int(Path("/proc/sys/net/core/somaxconn").read_text())
    except (OSError, ValueError):
        return 4096


async def serve(host: str, port: int, latency: float, ready_file: Path | None) -> None:
    """Serve until SIGTERM/SIGINT; write "host:port" to `ready_file` once listening."""
    raise_fd_limit()
    _Http.latency = latency
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Http, host, port, backlog=somaxconn(), reuse_address=True)
    bound = server.sockets[0].getsockname()[1]
    if ready_file:
        write_ready_file(ready_file, f"{host}:{bound}")
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    """Command line: --host, --port (0 = free port), --latency SECONDS, --ready-file PATH."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per /verify")
    parser.add_argument("--ready-file", type=Path)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port, args.latency, args.ready_file))


if __name__ == "__main__":
    main()
