"""What the bridge's grpc.aio server is made with: its channel options and its TLS
credentials."""

from __future__ import annotations

import grpc

from nemo_gym_grpc.bridge.process.config import BridgeConfig

# The fewest calls gRPC's core may hold that arrived but that the bridge has not picked up yet.
# Past its defaults (1,000, dropping at random up to 3,000) a burst of calls on one connection
# loses calls with a bare CANCELLED, and grpc.aio picks calls up one at a time: one client that
# opened 4,000 sessions at once lost a third of them (tests/test_call_bursts.py).
MIN_PENDING_CALLS = 65536


def pending_calls(config: BridgeConfig) -> int:
    """How many calls may wait for the bridge to pick them up: at least MIN_PENDING_CALLS, and
    room for every session call, stream and health Watch the limits allow at once."""
    allowed = config.max_sessions + config.max_streams + config.max_health_watches
    return max(MIN_PENDING_CALLS, allowed)


def grpc_options(config: BridgeConfig) -> list[tuple[str, int]]:
    """grpc.aio server options: message limits, keepalive, connection age and count, handshake
    time, no port sharing, and room for bursts of calls (`pending_calls`)."""
    pending = pending_calls(config)
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", int(config.reuse_port)),
        # Ping idle clients every 60 s; drop ones silent for 20 s more. Accept client pings
        # every 10 s or slower.
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.server_handshake_timeout_ms", int(config.handshake_timeout * 1000)),
        ("grpc.max_allowed_incoming_connections", config.max_connections),
        # one limit for both: no random drop below it
        ("grpc.server.max_pending_requests", pending),
        ("grpc.server.max_pending_requests_hard_limit", pending),
    ]
    if config.max_connection_age > 0:
        options += [
            ("grpc.max_connection_age_ms", int(config.max_connection_age * 1000)),
            ("grpc.max_connection_age_grace_ms", int(config.grace * 1000)),
        ]
    return options


def credentials(config: BridgeConfig) -> grpc.ServerCredentials | None:
    """The TLS credentials of `config` (mTLS when it names a client CA), None without TLS."""
    if not config.tls_cert or not config.tls_key:
        return None
    ca = config.tls_client_ca.read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )
