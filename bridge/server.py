"""Run the bridge: a grpc.aio server on one event loop, an aiohttp session for the upstreams."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc

from nemo_gym_grpc.bridge.service import VerifyService
from nemo_gym_grpc.bridge.upstreams import Upstreams
from nemo_gym_grpc.bridge.verifier import RetryPolicy, Verifier
from nemo_gym_grpc.v1 import verify_pb2_grpc

log = logging.getLogger(__name__)

MiB = 1024 * 1024


@dataclass
class BridgeConfig:
    """Settings of one bridge process (the `serve` command's flags).

    Attributes:
        listen: gRPC address "host:port" (port 0 = any free port).
        head_url: NeMo Gym head server base URL for discovery, or None.
        servers: static {resources server name: base URL}.
        verify_timeout: default seconds for one upstream `/verify` call.
        max_in_flight: most concurrent `/verify` calls per upstream.
        retry: retry policy for transient upstream failures (UNAVAILABLE, RESOURCE_EXHAUSTED).
        max_stream_items: most items one VerifyStream holds at once.
        max_message_bytes: gRPC receive/send limit per message, bytes (gRPC's default
            receive limit of 4 MiB is too small for 64 long completions).
        grace: seconds in-flight RPCs get to finish on SIGTERM/SIGINT.
        ready_file: if set, "host:port" of the bound address is written here once serving.
    """

    listen: str = "127.0.0.1:50051"
    head_url: str | None = None
    servers: dict[str, str] = field(default_factory=dict)
    verify_timeout: float = 30.0
    max_in_flight: int = 64
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_stream_items: int = 4096
    max_message_bytes: int = 64 * MiB
    grace: float = 10.0
    ready_file: Path | None = None


def grpc_options(config: BridgeConfig) -> list[tuple[str, int]]:
    """grpc.aio server options: message limits and no accidental port sharing."""
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


async def serve(config: BridgeConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop` is set), then drain for `config.grace` seconds.

    Raises RuntimeError when the listen address cannot be bound.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector) as session:
        upstreams = Upstreams(config.servers, config.head_url, session)
        if config.head_url:
            try:
                found = await upstreams.discover()
                log.info("discovered from %s: %s", config.head_url, found or "no servers")
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.warning(
                    "discovery from %s failed (will retry on demand): %r", config.head_url, exc
                )
        for entry in upstreams.entries():
            log.info("route %s -> %s (%s)", entry.name, ", ".join(entry.urls), entry.source)

        server = grpc.aio.server(options=grpc_options(config))
        verifier = Verifier(
            upstreams, session, config.verify_timeout, config.max_in_flight, config.retry
        )
        verify_pb2_grpc.add_VerifyServiceServicer_to_server(
            VerifyService(verifier, config.max_stream_items), server
        )
        try:
            port = server.add_insecure_port(config.listen)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {config.listen}: {exc}") from None
        await server.start()
        host = config.listen.rsplit(":", 1)[0]
        address = f"{host}:{port}"
        log.info("nemo-gym-grpc bridge listening on %s (pid %d)", address, os.getpid())
        if config.ready_file:
            tmp = config.ready_file.with_name(config.ready_file.name + ".tmp")
            tmp.write_text(address + "\n")
            tmp.replace(config.ready_file)
        try:
            await stop.wait()
        finally:
            log.info("stopping: %.1f s grace for in-flight RPCs", config.grace)
            await server.stop(config.grace)
