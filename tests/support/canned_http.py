"""A scripted HTTP/1.1 server that answers each request with raw bytes set by the test, run in
background threads on a loopback address:

    with CannedServer("127.0.0.3") as server:
        server.answer("GET /", canned(302, b"", Location="http://127.0.0.2:9/"))
        server.url, server.seen          # "http://127.0.0.3:PORT", ["GET /", ...]

A stand-in, not a NeMo Gym server: the tests need replies no real server sends on demand (a
malformed head-server config, a redirect, broken framing, a bad `Set-Cookie`). The raw bytes go
out as given, so framing errors reach the client unchanged; the connection is closed after
each answer. A request with no answer set gets 404.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time


def canned(status: int, body: bytes = b"", **headers: str) -> bytes:
    """A well-formed HTTP/1.1 response: `status`, `headers` (underscores in names become
    dashes), Content-Length and `Connection: close`, then `body`."""
    lines = [f"HTTP/1.1 {status} X"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    lines += [f"Content-Length: {len(body)}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _Canned:
    """What both kinds of server hold: the answers, the requests seen, the work per request."""

    allow_reuse_address = True
    request_queue_size = 1024
    answers: dict[str, bytes]
    seen: list[str]
    work: float = 0.0


class _Server(_Canned, socketserver.ThreadingTCPServer):
    daemon_threads = True


class _OneAtATime(_Canned, socketserver.TCPServer):
    """One request at a time, the others waiting in the listen backlog: a server whose
    latency grows with its load, as a single-process CPU-bound NeMo Gym server's does."""


class _Handler(socketserver.StreamRequestHandler):
    server: _Server | _OneAtATime

    def handle(self) -> None:
        self.connection.settimeout(10)
        try:
            first = self.rfile.readline(65536).decode("latin-1").split()
            length = 0
            while (line := self.rfile.readline(65536)) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            self.rfile.read(length)
        except (OSError, ValueError):
            return
        key = " ".join(first[:2])
        self.server.seen.append(key)
        path = first[1].split("?")[0] if len(first) > 1 else ""
        raw = self.server.answers.get(key) or self.server.answers.get(f"{first[0]} {path}")
        if self.server.work:
            time.sleep(self.server.work)
        try:
            self.wfile.write(raw if raw is not None else canned(404))
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class CannedServer:
    """See the module docstring.

    Args:
        host: the loopback address to listen on (127.0.0.0/8 is all loopback on Linux).
        work: seconds each request takes before its answer goes out.
        one_at_a_time: serve one request at a time (else each in a thread of its own).

    Attributes:
        url: "http://<host>:<port>".
        seen: "<METHOD> <target>" of each request, in order.
    """

    def __init__(
        self, host: str = "127.0.0.1", *, work: float = 0.0, one_at_a_time: bool = False
    ) -> None:
        kind = _OneAtATime if one_at_a_time else _Server
        self._server = kind((host, 0), _Handler)  # type: ignore[arg-type]
        self._server.work = work
        self._server.answers = {}
        self._server.seen = []
        self.seen = self._server.seen
        self.url = f"http://{host}:{self._server.server_address[1]}"
        # serve_forever polls for shutdown every 0.5 s by default: each exit waited that long.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def answer(self, key: str, raw: bytes) -> None:
        """Answer requests "<METHOD> <path>" (query ignored unless the key has it) with `raw`."""
        self._server.answers[key] = raw

    def __enter__(self) -> CannedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
