"""Run the bridge: a grpc.aio server on one event loop, an aiohttp session for the upstreams,
health checking, reflection, optional TLS/mTLS and bearer-token auth, Prometheus metrics,
graceful drain."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
from dataclasses import dataclass

import aiohttp
import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from nemo_gym_grpc.bridge.flows.discovery import HeadServer
from nemo_gym_grpc.bridge.flows.run import Runner
from nemo_gym_grpc.bridge.flows.session import Sessions
from nemo_gym_grpc.bridge.flows.upstreams import AGENTS, Upstreams
from nemo_gym_grpc.bridge.flows.verify import Verifier
from nemo_gym_grpc.bridge.nemo_gym import destinations, framing, http
from nemo_gym_grpc.bridge.nemo_gym.head import AGENT, ENVIRONMENT
from nemo_gym_grpc.bridge.process import descriptors, share
from nemo_gym_grpc.bridge.process.allocator import collect_less, return_large_frees
from nemo_gym_grpc.bridge.process.checks import check_exposure, check_limits, check_tls
from nemo_gym_grpc.bridge.process.config import BridgeConfig
from nemo_gym_grpc.bridge.process.metrics import Metrics, start_metrics_server
from nemo_gym_grpc.bridge.rpc import transport
from nemo_gym_grpc.bridge.rpc.budget import Budget
from nemo_gym_grpc.bridge.rpc.health import NOT_SERVING, Readiness
from nemo_gym_grpc.bridge.rpc.interceptors import (
    BearerTokenInterceptor,
    HealthBudgetInterceptor,
    StreamLimitInterceptor,
)
from nemo_gym_grpc.bridge.rpc.rollout_service import RolloutService, add_rollout_service
from nemo_gym_grpc.bridge.rpc.session_service import SessionService, add_session_service
from nemo_gym_grpc.bridge.rpc.verify_service import VerifyService, add_verify_service
from nemo_gym_grpc.shared import stragglers
from nemo_gym_grpc.shared.child import write_ready_file
from nemo_gym_grpc.shared.contract import SERVICES

log = logging.getLogger(__name__)


async def _metrics_server(config: BridgeConfig, metrics: Metrics) -> web.AppRunner | None:
    """The Prometheus metrics server when `config.metrics_port` is set (its address logged),
    else None."""
    if config.metrics_port is None:
        return None
    runner = await start_metrics_server(metrics, config.metrics_host, config.metrics_port)
    host, port = runner.addresses[0][:2]
    log.info("Prometheus metrics on http://%s:%d/metrics", host, port)
    return runner


async def _check_stragglers(runner: Runner) -> None:
    """`runner.check_stragglers()` every `stragglers.CHECK_EVERY` seconds (cancel to stop)."""
    while True:
        await asyncio.sleep(stragglers.CHECK_EVERY)
        runner.check_stragglers()


async def _watch_parent(stop: asyncio.Event) -> None:
    parent = os.getppid()
    while os.getppid() == parent:  # noqa: ASYNC110 (no event exists for a parent exit)
        await asyncio.sleep(1.0)
    log.warning("parent process %d exited: stopping", parent)
    stop.set()


@dataclass
class Bridge:
    """A bridge that `build` wired and bound, not yet serving.

    Attributes:
        server: the grpc.aio server, port bound, not started.
        address: the bound "host:port" (the actual port where the config asked for 0).
        health: the grpc.health servicer; "" and the VerifyService are NOT_SERVING until the
            first `readiness.round()`.
        readiness: sets the health statuses from discovery and upstream probes.
        metrics: the counters and gauges `/metrics` serves.
        tls: whether the server speaks TLS.
        verifier: scores the items; `aclose()` on drain ends its background calls.
        runner: runs the rollouts (RolloutService).
        sessions: the open sessions (SessionService); `aclose()` on drain closes them.
    """

    server: grpc.aio.Server
    address: str
    health: health.aio.HealthServicer
    readiness: Readiness
    metrics: Metrics
    tls: bool
    verifier: Verifier
    runner: Runner
    sessions: Sessions


async def build(config: BridgeConfig, client: http.Client) -> Bridge:
    """Wire a bridge for `config` on the running event loop: routing tables (resources
    servers; agents and environment servers), interceptors (token auth, health budget, stream
    limit), metrics, the verify and run flows, services (VerifyService, RolloutService, health,
    reflection) and the bound port. `config` is taken as checked (`check_tls`, `check_exposure`,
    `check_limits`); `client` carries every upstream call.

    Raises:
        RuntimeError: the listen address cannot be bound.
        OSError: a TLS file cannot be read.
    """
    session = client.session
    upstreams, agents = _routing_tables(config, session)
    stream_limit = StreamLimitInterceptor(config.max_streams, config.stream_idle_timeout)
    health_budget = HealthBudgetInterceptor(config.max_health_watches)
    interceptors: list[grpc.aio.ServerInterceptor] = [health_budget, stream_limit]
    if config.token:
        interceptors.insert(0, BearerTokenInterceptor(config.token))
    server = grpc.aio.server(options=transport.grpc_options(config), interceptors=interceptors)
    metrics = Metrics()
    verifier, runner = _flows(config, client, upstreams, agents, metrics)
    metrics.watch(
        verifier.balancer, lambda: (stream_limit.active, stream_limit.waiting), client.replies
    )
    metrics.watch_rollouts(runner.load)
    budget = Budget(config.max_held_bytes)
    limits = {
        "max_stream_items": config.max_stream_items,
        "max_batch_items": config.max_batch_items or config.max_stream_items,
        "max_message_bytes": config.max_message_bytes,
        "max_stream_bytes": config.max_stream_bytes,
        "budget": budget,
        "idle_timeout": config.stream_idle_timeout,
    }
    add_verify_service(VerifyService(verifier, **limits), server)
    add_rollout_service(RolloutService(runner, **limits), server)
    sessions = Sessions(
        upstreams, client, balancer=verifier.balancer, catalog=verifier.capabilities,
        metrics=metrics, default_timeout=config.verify_timeout,
        max_item_bytes=config.max_item_bytes, lease=config.session_lease,
        max_sessions=config.max_sessions,
    )  # fmt: skip
    add_session_service(SessionService(sessions, verifier, budget), server)
    health_servicer = await _add_health(server)
    credentials = transport.credentials(config)
    port = _bind(server, config, credentials)
    readiness = Readiness(
        health_servicer, upstreams, session, config.health_interval, agents=agents
    )
    return Bridge(
        server=server,
        address=f"{config.listen.rsplit(':', 1)[0]}:{port}",
        health=health_servicer,
        readiness=readiness,
        metrics=metrics,
        tls=credentials is not None,
        verifier=verifier,
        runner=runner,
        sessions=sessions,
    )


def _routing_tables(
    config: BridgeConfig, session: aiohttp.ClientSession
) -> tuple[Upstreams, Upstreams]:
    """The RESOURCES table (`--server`) and the AGENTS table (`--agent`,
    `--environment-server`), both discovering from `--head-url` (one read serves both)."""
    head_server = HeadServer(config.head_url, session) if config.head_url else None
    upstreams = Upstreams(config.servers, head_server)
    agents = Upstreams(
        {**config.agents, **config.environment_servers},
        head_server,
        kind=AGENTS,
        static_protocols={
            **{name: AGENT for name in config.agents},
            **{name: ENVIRONMENT for name in config.environment_servers},
        },
    )
    return upstreams, agents


def _flows(
    config: BridgeConfig,
    client: http.Client,
    upstreams: Upstreams,
    agents: Upstreams,
    metrics: Metrics,
) -> tuple[Verifier, Runner]:
    """The verify flow over `upstreams` and the run flow over `agents`."""
    verifier = Verifier(
        upstreams=upstreams,
        client=client,
        default_timeout=config.verify_timeout,
        max_in_flight=config.fixed_concurrency or config.max_in_flight,
        retry=config.retry,
        max_item_bytes=config.max_item_bytes,
        session_servers=config.session_servers,
        metrics=metrics,
        rollout_correlation=config.rollout_correlation,
        adaptive_concurrency=config.fixed_concurrency is None,
        queue_share=config.sharing_bridges * config.share_factor,
    )
    runner = Runner(
        agents,
        client,
        default_timeout=config.run_timeout,
        concurrency=config.agent_concurrency,
        retry=config.retry,
        max_item_bytes=config.max_item_bytes,
        metrics=metrics,
    )
    return verifier, runner


async def _add_health(server: grpc.aio.Server) -> health.aio.HealthServicer:
    """Health checking (every service NOT_SERVING until the first readiness round) and
    reflection of the bridge's services."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = tuple(service.full_name for service in SERVICES)
    for name in ("", *names):  # the servicer starts "" SERVING
        await servicer.set(name, NOT_SERVING)
    reflection.enable_server_reflection(
        (*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return servicer


def _bind(
    server: grpc.aio.Server, config: BridgeConfig, credentials: grpc.ServerCredentials | None
) -> int:
    """Bind `config.listen`; returns the port.

    Raises:
        RuntimeError: "cannot listen on ...", naming the cause.
    """
    check_free(config.listen, config.reuse_port)
    try:
        if credentials:
            return server.add_secure_port(config.listen, credentials)
        return server.add_insecure_port(config.listen)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen on {config.listen}: {exc}") from None


def check_free(listen: str, reuse_port: bool) -> None:
    """Refuse a `listen` address that another socket listens on, before gRPC tries it: gRPC's
    core would log a line of its own and raise only "Failed to bind". Each address `listen`
    resolves to is bound as gRPC binds it (SO_REUSEADDR; SO_REUSEPORT for `--workers`), then
    released; like gRPC, one free address is enough. Port 0 and unix: sockets pass.

    Raises:
        RuntimeError: "cannot listen on LISTEN: address already in use".
    """
    host, _, port = listen.rpartition(":")
    if listen.startswith("unix:") or port == "0":
        return
    try:
        found = socket.getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, ValueError):
        return  # gRPC says what is wrong with it
    for family, kind, protocol, _, address in found:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    continue
            return
    if found:
        raise RuntimeError(f"cannot listen on {listen}: address already in use")


def _session(policy: destinations.Policy | None = None) -> aiohttp.ClientSession:
    """The aiohttp session for the upstream calls of one bridge: no cookie jar, `framing`'s
    header limits, and `policy` (default `Policy()`) applied to every address it dials."""
    policy = policy or destinations.Policy()
    # Idle upstream connections are closed after 15 s: NeMo Gym's uvicorn closes them after
    # 30 s, and reusing one just as the server closes it costs a retry.
    connector = aiohttp.TCPConnector(
        limit=0,
        limit_per_host=0,
        keepalive_timeout=15,
        resolver=destinations.FilteringResolver(policy),
    )
    # No cookie jar: NeMo Gym sets a session cookie on every reply; a shared jar would send
    # it with other items' calls. An item's session cookies travel explicitly
    # (nemo_gym/sessions.py).
    return aiohttp.ClientSession(
        connector=connector,
        cookie_jar=aiohttp.DummyCookieJar(),
        trace_configs=[destinations.trace_config(policy)],
        max_line_size=framing.MAX_LINE_BYTES,  # framing's table of header limits
        max_field_size=framing.MAX_LINE_BYTES,
        max_headers=framing.MAX_HEADERS,
    )


async def serve(config: BridgeConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop` is set), then drain.

    Start: the first readiness round (routes and health before the first call), the metrics
    server if `config.metrics_port` is set, the gRPC server, the ready file. Drain: health
    goes NOT_SERVING, new calls get UNAVAILABLE, in-flight calls get `config.grace` seconds
    to finish, then the rest are cancelled.

    Raises:
        ValueError: an unsafe or inconsistent exposure, limits or TLS files
            (`check_exposure`, `check_limits`, `check_tls`).
        RuntimeError: the listen address cannot be bound.
        OSError: the metrics address cannot be bound, or a TLS file cannot be read.
    """
    check_tls(config)
    check_exposure(config)
    check_limits(config)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    deny = destinations.DEFAULT_DENY + config.deny_upstream
    policy = destinations.Policy(deny, config.allow_upstream)
    async with _session(policy) as session:
        client = http.Client(
            session, builtin=config.upstream_client == "builtin", policy=policy,
            max_reply_bytes=config.max_reply_bytes, max_replies_bytes=config.max_replies_bytes,
        )  # fmt: skip
        bridge = await build(config, client)
        await bridge.readiness.round()
        metrics_runner = await _metrics_server(config, bridge.metrics)
        await bridge.server.start()
        background = [
            asyncio.create_task(bridge.readiness.run()),
            asyncio.create_task(_check_stragglers(bridge.runner)),
        ]
        if config.exit_with_parent:
            background.append(asyncio.create_task(_watch_parent(stop)))
        if config.sharing_bridges_file and bridge.verifier.balancer.share is not None:
            balancer, factor = bridge.verifier.balancer, config.share_factor
            follow = share.follow(config.sharing_bridges_file, balancer, factor)
            background.append(asyncio.create_task(follow))
        log.info(
            "nemo-gym-grpc bridge listening on %s (pid %d, %s%s)",
            bridge.address,
            os.getpid(),
            "TLS" if bridge.tls else "plaintext",
            ", token auth" if config.token else "",
        )
        if config.ready_file:
            write_ready_file(config.ready_file, bridge.address)
        try:
            await stop.wait()
        finally:
            await _drain(bridge, config.grace, background)
            await client.aclose()
            if metrics_runner is not None:
                await metrics_runner.cleanup()
            log.info("stopped")


async def _drain(bridge: Bridge, grace: float, background: list[asyncio.Task[None]]) -> None:
    """Health NOT_SERVING, the `background` tasks cancelled, in-flight calls given `grace`
    seconds, then every open session and background `/close_session` call ended."""
    log.info("draining: NOT_SERVING, %.1f s grace for in-flight calls", grace)
    await bridge.health.enter_graceful_shutdown()
    for task in background:
        task.cancel()
    await bridge.server.stop(grace)
    await bridge.sessions.aclose()  # every open session closed upstream
    await bridge.verifier.aclose()  # background /close_session calls


def run(config: BridgeConfig) -> None:
    """Run `serve(config)` to completion on a new event loop: uvloop's where it is installed
    (measured here: fewer CPU microseconds per item than asyncio's default loop), else
    asyncio's, with large freed blocks returned to the system and the cycle collector run less
    often (`allocator`), and the open-files limit raised for its limits (`descriptors`). Raises
    what `serve` raises."""
    return_large_frees()
    collect_less()
    descriptors.raise_limit(config.max_in_flight + config.max_connections + 1024)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))
