"""An aiohttp application served on a free loopback port, for the stand-ins that tests and
benchmarks write as aiohttp handlers (each says why it is a stand-in)."""

from __future__ import annotations

from aiohttp import web


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve `app` on 127.0.0.1 at a free port: (its runner, for `await runner.cleanup()`;
    its base URL, "http://127.0.0.1:PORT")."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"
