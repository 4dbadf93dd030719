"""Run the bridge: a grpc.aio server on one event loop, an aiohttp session for the upstreams,
health checking, reflection, optional TLS/mTLS and bearer-token auth, Prometheus metrics,
graceful drain."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from nemo_gym_grpc.bridge.health import NOT_SERVING, SERVICE_NAME, Readiness
from nemo_gym_grpc.bridge.interceptors import BearerTokenInterceptor, StreamLimitInterceptor
from nemo_gym_grpc.bridge.metrics import Metrics, start_metrics_server
from nemo_gym_grpc.bridge.service import VerifyService, parse_verify_request
from nemo_gym_grpc.bridge.upstreams import Upstreams
from nemo_gym_grpc.bridge.verifier import RetryPolicy, Verifier
from nemo_gym_grpc.v1 import verify_pb2

log = logging.getLogger(__name__)

MiB = 1024 * 1024


@dataclass
class BridgeConfig:
    """Settings of one bridge process (the `serve` command's flags).

    Attributes:
        listen: gRPC address "host:port" (port 0 = any free port).
        head_url: NeMo Gym head server base URL for discovery, or None.
        servers: static {resources server name: base URL, or a list of them (replicas)}.
        session_servers: names whose items always run as their own NeMo Gym session
            (`/seed_session` first), as if each set `VerifyRequest.seed_session`.
        verify_timeout: default seconds for one upstream `/verify` attempt.
        max_in_flight: most concurrent upstream calls per upstream replica.
        retry: retry policy for transient upstream failures (UNAVAILABLE, RESOURCE_EXHAUSTED).
        max_stream_items: most items one VerifyStream holds at once.
        max_batch_items: most items in one VerifyStreamRequest message; None = the same as
            `max_stream_items`, which it may not exceed.
        max_streams: most concurrent VerifyStream calls.
        max_message_bytes: gRPC receive/send limit per message, bytes (gRPC's default
            receive limit of 4 MiB is too small for 64 long completions).
        max_item_bytes: largest item accepted, serialized bytes; larger ones fail alone
            with INVALID_ARGUMENT / ITEM_TOO_LARGE.
        grace: seconds in-flight RPCs get to finish on SIGTERM/SIGINT.
        max_connection_age: seconds after which a client connection is asked to reconnect
            (GOAWAY), so long-lived clients rebalance across replicas; 0 = never.
        tls_cert, tls_key: PEM files; both set = serve TLS.
        tls_client_ca: PEM CA bundle; set = require client certificates (mTLS).
        token: bearer token clients must send; None = no token auth.
        insecure: allow a non-loopback listen address without TLS or token.
        reuse_port: let several processes bind the same port (`serve --workers N`).
        ready_file: if set, "host:port" of the bound address is written here once serving.
        exit_with_parent: stop when the parent process (the one that started us) exits.
        health_interval: seconds between readiness rounds.
        metrics_host, metrics_port: where to serve Prometheus `/metrics` over HTTP;
            port None = no metrics server (0 = any free port, logged).
    """

    listen: str = "127.0.0.1:50051"
    head_url: str | None = None
    servers: dict[str, str | list[str]] = field(default_factory=dict)
    session_servers: tuple[str, ...] = ()
    verify_timeout: float = 30.0
    max_in_flight: int = 256
    retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(attempts=3, budget=60.0))
    max_stream_items: int = 4096
    max_batch_items: int | None = None
    max_streams: int = 256
    max_message_bytes: int = 64 * MiB
    max_item_bytes: int = 16 * MiB
    grace: float = 10.0
    max_connection_age: float = 0.0
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    token: str | None = None
    insecure: bool = False
    reuse_port: bool = False
    ready_file: Path | None = None
    exit_with_parent: bool = False
    health_interval: float = 5.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None


def is_loopback(listen: str) -> bool:
    """True for unix: sockets and loopback hosts (127.0.0.0/8, ::1, localhost)."""
    if listen.startswith("unix:"):
        return True
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(config: BridgeConfig) -> None:
    """Refuse a non-loopback listen address with neither TLS nor a token, unless insecure.

    Raises:
        ValueError: naming the address and the flags that allow it; also for half a TLS pair.
    """
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    if config.tls_client_ca and not config.tls_cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    if is_loopback(config.listen) or config.tls_cert or config.token or config.insecure:
        return
    raise ValueError(
        f"refusing to listen on non-loopback {config.listen} without TLS or a token: "
        "set --tls-cert/--tls-key and/or --token-file (or NEMO_GYM_GRPC_TOKEN), "
        "or pass --insecure"
    )


def check_limits(config: BridgeConfig) -> None:
    """Refuse limits that contradict each other.

    Raises:
        ValueError: a limit below 1, or `max_batch_items` over `max_stream_items` (a message
            is parsed whole, so a bigger one would break the bound on items held per stream).
    """
    for flag, value in (
        ("--max-stream-items", config.max_stream_items),
        ("--max-batch-items", config.max_batch_items),
        ("--max-in-flight", config.max_in_flight),
        ("--max-streams", config.max_streams),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if config.max_batch_items is not None and config.max_batch_items > config.max_stream_items:
        raise ValueError(
            f"--max-batch-items {config.max_batch_items} exceeds --max-stream-items "
            f"{config.max_stream_items}: a message is parsed whole, so it may not hold more "
            "items than a stream holds at once"
        )


def add_verify_service(service: VerifyService, server: grpc.aio.Server) -> None:
    """Register `service` like the generated `add_VerifyServiceServicer_to_server`, except that
    `Verify` parses its request with `parse_verify_request`: a message gRPC cannot parse
    (invalid UTF-8 in a string field) gets INVALID_ARGUMENT instead of UNKNOWN."""
    handlers = {
        "Verify": grpc.unary_unary_rpc_method_handler(
            service.Verify,
            request_deserializer=parse_verify_request,
            response_serializer=verify_pb2.VerifyResponse.SerializeToString,
        ),
        "VerifyStream": grpc.stream_stream_rpc_method_handler(
            service.VerifyStream,
            request_deserializer=verify_pb2.VerifyStreamRequest.FromString,
            response_serializer=verify_pb2.VerifyStreamResponse.SerializeToString,
        ),
        "ListResourcesServers": grpc.unary_unary_rpc_method_handler(
            service.ListResourcesServers,
            request_deserializer=verify_pb2.ListResourcesServersRequest.FromString,
            response_serializer=verify_pb2.ListResourcesServersResponse.SerializeToString,
        ),
    }
    generic = grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
    server.add_generic_rpc_handlers((generic,))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def grpc_options(config: BridgeConfig) -> list[tuple[str, int]]:
    """grpc.aio server options: message limits, keepalive, connection age, no port sharing."""
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", int(config.reuse_port)),
        # Ping idle clients every 60 s; drop ones silent for 20 s more. Accept client pings
        # every 10 s or slower.
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]
    if config.max_connection_age > 0:
        options += [
            ("grpc.max_connection_age_ms", int(config.max_connection_age * 1000)),
            ("grpc.max_connection_age_grace_ms", int(config.grace * 1000)),
        ]
    return options


def _credentials(config: BridgeConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert or not config.tls_key:
        return None
    ca = config.tls_client_ca.read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


async def _watch_parent(stop: asyncio.Event) -> None:
    parent = os.getppid()
    while os.getppid() == parent:  # noqa: ASYNC110 (no event exists for a parent exit)
        await asyncio.sleep(1.0)
    log.warning("parent process %d exited: stopping", parent)
    stop.set()


async def serve(config: BridgeConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop` is set), then drain.

    Drain: health goes NOT_SERVING, new calls get UNAVAILABLE, in-flight calls get
    `config.grace` seconds to finish, then the rest are cancelled.

    Raises:
        ValueError: an unsafe or inconsistent exposure or limits (`check_exposure`,
            `check_limits`).
        RuntimeError: the listen address cannot be bound.
        OSError: the metrics address cannot be bound.
    """
    check_exposure(config)
    check_limits(config)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    # Idle upstream connections are closed after 15 s: NeMo Gym's uvicorn closes them after
    # 30 s, and reusing one just as the server closes it costs a retry.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=15)
    # No cookie jar: NeMo Gym sets a session cookie on every reply; a shared jar would send
    # it with other items' calls. An item's session cookies travel explicitly (sessions.py).
    cookies = aiohttp.DummyCookieJar()
    async with aiohttp.ClientSession(connector=connector, cookie_jar=cookies) as session:
        upstreams = Upstreams(config.servers, config.head_url, session)
        stream_limit = StreamLimitInterceptor(config.max_streams)
        interceptors: list[grpc.aio.ServerInterceptor] = [stream_limit]
        if config.token:
            interceptors.insert(0, BearerTokenInterceptor(config.token))
        server = grpc.aio.server(options=grpc_options(config), interceptors=interceptors)
        metrics = Metrics()
        verifier = Verifier(
            upstreams,
            session,
            default_timeout=config.verify_timeout,
            max_in_flight=config.max_in_flight,
            retry=config.retry,
            max_item_bytes=config.max_item_bytes,
            session_servers=config.session_servers,
            metrics=metrics,
        )
        metrics.watch(verifier.balancer, lambda: stream_limit.active)
        max_batch_items = config.max_batch_items or config.max_stream_items
        service = VerifyService(
            verifier, max_stream_items=config.max_stream_items, max_batch_items=max_batch_items
        )
        add_verify_service(service, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        credentials = _credentials(config)
        try:
            if credentials:
                port = server.add_secure_port(config.listen, credentials)
            else:
                port = server.add_insecure_port(config.listen)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {config.listen}: {exc}") from None
        for service in ("", SERVICE_NAME):  # the servicer starts "" as SERVING
            await health_servicer.set(service, NOT_SERVING)
        readiness = Readiness(health_servicer, upstreams, session, config.health_interval)
        await readiness.round()  # routes (and the SERVING status) before the first call
        metrics_runner = None
        if config.metrics_port is not None:
            metrics_runner = await start_metrics_server(
                metrics, config.metrics_host, config.metrics_port
            )
            host, port_bound = metrics_runner.addresses[0][:2]
            log.info("Prometheus metrics on http://%s:%d/metrics", host, port_bound)
        await server.start()
        background = [asyncio.create_task(readiness.run())]
        if config.exit_with_parent:
            background.append(asyncio.create_task(_watch_parent(stop)))
        address = f"{config.listen.rsplit(':', 1)[0]}:{port}"
        log.info(
            "nemo-gym-grpc bridge listening on %s (pid %d, %s%s)",
            address,
            os.getpid(),
            "TLS" if credentials else "plaintext",
            ", token auth" if config.token else "",
        )
        if config.ready_file:
            write_ready_file(config.ready_file, address)
        try:
            await stop.wait()
        finally:
            log.info("draining: NOT_SERVING, %.1f s grace for in-flight calls", config.grace)
            await health_servicer.enter_graceful_shutdown()
            for task in background:
                task.cancel()
            await server.stop(config.grace)
            if metrics_runner is not None:
                await metrics_runner.cleanup()
            log.info("stopped")


def run(config: BridgeConfig) -> None:
    """Run `serve(config)` to completion on a new event loop: uvloop's where it is installed
    (measured here: fewer CPU microseconds per item than asyncio's default loop), else
    asyncio's. Raises what `serve` raises."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))


def write_ready_file(path: Path, address: str) -> None:
    """Atomically write "host:port\\n" to `path` (readers never see a partial file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(address + "\n")
    tmp.replace(path)
