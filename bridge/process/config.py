"""The bridge's settings: `BridgeConfig`, each field declared once with the flag(s) that set it
(`bridge.process.checks` refuses unsafe or contradictory ones).

`nemo-gym-grpc serve` generates its flags from the fields (`BridgeConfig.flags`) and builds the
config with `BridgeConfig.from_args`; Python code constructs `BridgeConfig(...)` directly with
keyword arguments. `serve --help` prints every flag's help, default and environment variable.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_gym_grpc.bridge.flows.attempts import RetryPolicy
from nemo_gym_grpc.bridge.nemo_gym.http import DEFAULT_MAX_REPLIES_BYTES, DEFAULT_MAX_REPLY_BYTES
from nemo_gym_grpc.bridge.process.options import option, routes, setting
from nemo_gym_grpc.shared import contract
from nemo_gym_grpc.shared.contract import MAX_MESSAGE_BYTES, RUN_TIMEOUT_ENV, TOKEN_ENV, MiB
from nemo_gym_grpc.shared.flags import (
    Flag,
    http_url,
    listen_address,
    network,
    non_negative_float,
    port,
    positive_float,
    positive_int,
    readable_file,
    token_file,
)


@dataclass(kw_only=True)
class BridgeConfig:
    """Settings of one bridge process. Each field's meaning and unit is its flag's help.

    Fields that hold a converted value: `servers` (and `agents`, `environment_servers`) is
    {server name: base URL, or a list of them (replicas)}; `retry` a `RetryPolicy`;
    `max_item_bytes`, `max_message_bytes`, `max_reply_bytes`, `max_replies_bytes`,
    `max_stream_bytes` and `max_held_bytes` are bytes (their flags take MiB); `token` is the
    token itself (its flag names a file, its variable holds the token).
    `reuse_port` and `share_factor` have no flag.
    """

    listen: str = option(
        "--listen",
        "gRPC address HOST:PORT ([IPv6]:PORT; port 0 = any free port) or unix:PATH",
        type=listen_address,
        default="127.0.0.1:50051",
        metavar="HOST:PORT",
    )
    head_url: str | None = option(
        "--head-url",
        "NeMo Gym head server URL, e.g. http://127.0.0.1:11000, to discover servers",
        type=http_url,
        metavar="URL",
    )
    servers: dict[str, str | list[str]] = routes(
        "--server",
        "a resources server base URL (repeatable; the same NAME again adds a replica, load "
        "goes to the least busy one); wins over discovery",
    )
    agents: dict[str, str | list[str]] = routes(
        "--agent",
        "a NeMo Gym agent server base URL (e.g. simple_agent) that Run/RunStream post "
        "rows to at <URL>/run (repeatable; the same NAME again adds a replica, load goes "
        "to the least busy one); wins over discovery",
    )
    environment_servers: dict[str, str | list[str]] = routes(
        "--environment-server",
        "a NeMo Gym (>= 0.7) environment server base URL that Run/RunStream post "
        "episodes to at <URL>/run (repeatable like --agent); wins over discovery",
    )
    deny_upstream: tuple[Any, ...] = option(
        "--deny-upstream",
        "an address range (CIDR) never dialed, besides link-local 169.254.0.0/16 and fe80::/10 "
        "(repeatable); an upstream there fails its items with UPSTREAM_ADDRESS_REFUSED",
        type=network, default=(), kind="list", metavar="CIDR", convert=tuple,
    )  # fmt: skip
    allow_upstream: tuple[Any, ...] = option(
        "--allow-upstream",
        "an address range (CIDR) to dial (repeatable); when given, upstreams outside every "
        "such range are refused like --deny-upstream ones",
        type=network, default=(), kind="list", metavar="CIDR", convert=tuple,
    )  # fmt: skip
    agent_concurrency: int = option(
        "--agent-concurrency",
        "most rollouts in flight per agent or environment server name, all replicas "
        "together; further rollouts wait for a slot (bounded by their RPC deadline)",
        type=positive_int,
        default=64,
        metavar="N",
    )
    run_timeout: float = option(
        "--run-timeout",
        "default seconds per rollout's /run call, from when it got its agent slot "
        "(RunRequest.timeout_seconds overrides it; the RPC deadline cuts it)",
        type=positive_float,
        default=3600.0,
        env=RUN_TIMEOUT_ENV,
        metavar="SECONDS",
    )
    session_servers: tuple[str, ...] = option(
        "--session-server",
        "run every item of this resources server as its own NeMo Gym session: "
        "/seed_session first, its cookies sent with the item's /verify (repeatable)",
        default=(),
        kind="list",
        metavar="NAME",
        convert=tuple,
    )
    rollout_correlation: bool = option(
        "--no-rollout-correlation",
        "send every upstream call to its plain route, never under NeMo Gym's "
        "/ng-rollout/<request_id> prefix (by default the prefix is used where the server "
        "takes it and the request_id is a valid rollout id)",
        default=False,
        kind="switch",
        convert=lambda off: not off,
    )
    upstream_client: str = option(
        "--upstream-client",
        "what carries the POSTs to http:// upstreams: builtin (the bridge's own HTTP/1.1 "
        "client, a fifth of aiohttp's CPU per call) or aiohttp (https:// upstreams always "
        "use aiohttp)",
        default="builtin",
        choices=("builtin", "aiohttp"),
    )
    verify_timeout: float = option(
        "--verify-timeout",
        "default seconds per upstream /verify call",
        type=positive_float,
        default=contract.VERIFY_TIMEOUT,
        metavar="SECONDS",
    )
    max_in_flight: int = option(
        "--max-in-flight",
        "most concurrent /verify calls per upstream: the ceiling of its adaptive limit (each "
        "upstream's calls follow a limit found from their latency, TCP Vegas's rule keeping a "
        "small standing queue at the server; docs/performance.md)",
        type=positive_int, default=16384, metavar="N",
    )  # fmt: skip
    fixed_concurrency: int | None = option(
        "--fixed-concurrency",
        "each upstream gets exactly N concurrent /verify calls, no adaptive limit "
        "(--max-in-flight is then unused)",
        type=positive_int, default=None, metavar="N",
    )  # fmt: skip
    sharing_bridges: int = option(
        "--sharing-bridges",
        "bridge processes whose calls reach the same NeMo Gym servers, this one included; "
        "each keeps 1/N of the standing queue the adaptive limit aims for, so that together "
        "they keep one (the Ray fleet sets it; serve --workers W multiplies it by W)",
        type=positive_int, default=1, metavar="N",
    )  # fmt: skip
    sharing_bridges_file: Path | None = option(
        "--sharing-bridges-file",
        "a file holding the --sharing-bridges number, read at start and whenever it changes, "
        "so that running bridges follow a fleet that grows or shrinks (the Ray fleet writes it)",
        type=Path, metavar="PATH",
    )  # fmt: skip
    retry: RetryPolicy = setting(
        Flag(
            "--retry-attempts",
            "most attempts per item for transient causes (connection errors, HTTP "
            "500/502/503/504/429), the first included (1 = no retries)",
            type=positive_int,
            default=3,
            metavar="N",
        ),
        Flag(
            "--retry-budget",
            "most seconds from an item's first attempt to the start of its last",
            type=non_negative_float,
            default=60.0,
            metavar="SECONDS",
        ),
        convert=lambda attempts, budget: RetryPolicy(attempts=attempts, budget=budget),
    )
    max_stream_items: int = option(
        "--max-stream-items",
        "most items one VerifyStream holds at once",
        type=positive_int,
        default=4096,
        metavar="N",
    )
    max_batch_items: int | None = option(
        "--max-batch-items",
        "most items in one VerifyStreamRequest message, at most --max-stream-items "
        "(default: the same as --max-stream-items)",
        type=positive_int,
        metavar="N",
    )
    max_item_bytes: int = option(
        "--max-item-mb",
        "largest item in MiB; a larger one fails alone with INVALID_ARGUMENT / ITEM_TOO_LARGE",
        type=positive_float,
        default=contract.DEFAULT_MAX_ITEM_BYTES / MiB,
        metavar="MIB",
        convert=lambda mb: int(mb * MiB),
    )
    max_streams: int = option(
        "--max-streams",
        "most concurrent VerifyStream and RunStream calls together; more wait for a place, "
        "unread, up to --stream-idle-timeout (within their deadline), then RESOURCE_EXHAUSTED",
        type=positive_int,
        default=64,
        metavar="N",
    )
    max_stream_bytes: int = option(
        "--max-stream-mb",
        "MiB of items and unsent results past which one VerifyStream or RunStream reads no "
        "further message until results go out (the sender waits: gRPC flow control)",
        type=positive_float,
        default=256.0,
        metavar="MIB",
        convert=lambda mb: int(mb * MiB),
    )
    max_held_bytes: int = option(
        "--max-held-mb",
        "MiB of items and unsent results of all streams and unary calls together past which "
        "no stream reads a further message and no unary call starts until results go out",
        type=positive_float,
        default=2048.0,
        metavar="MIB",
        convert=lambda mb: int(mb * MiB),
    )
    stream_idle_timeout: float = option(
        "--stream-idle-timeout",
        "seconds a VerifyStream or RunStream may hold no item and receive no message before "
        "the bridge ends it UNAVAILABLE / STREAM_IDLE (so idle clients cannot keep the "
        "--max-streams places), and the longest a stream waits for such a place; 0 = never",
        type=non_negative_float,
        default=300.0,
        metavar="SECONDS",
    )
    session_lease: float = option(
        "--session-lease",
        "seconds a SessionService session may stay idle (no call in progress) before the "
        "bridge closes it upstream (a request's lease_seconds overrides it)",
        type=positive_float,
        default=300.0,
        metavar="SECONDS",
    )
    max_sessions: int = option(
        "--max-sessions",
        "most SessionService sessions open at once; OpenSession beyond it fails "
        "RESOURCE_EXHAUSTED / TOO_MANY_SESSIONS",
        type=positive_int,
        default=16384,
        metavar="N",
    )
    max_health_watches: int = option(
        "--max-health-watches",
        "most concurrent health Watch calls (health is open without the token; each Watch "
        "holds a waiter while it is open)",
        type=positive_int,
        default=1024,
        metavar="N",
    )
    max_message_bytes: int = option(
        "--max-message-mb",
        "gRPC message size limit in MiB, both directions",
        type=positive_int,
        default=MAX_MESSAGE_BYTES // MiB,
        metavar="MIB",
        convert=lambda mb: mb * MiB,
    )
    max_reply_bytes: int = option(
        "--max-reply-mb",
        "largest NeMo Gym reply body in MiB, as sent and as decompressed; a larger one is not "
        "read further and fails its item with FAILED_PRECONDITION / UPSTREAM_REPLY_TOO_LARGE",
        type=positive_float,
        default=DEFAULT_MAX_REPLY_BYTES / MiB,
        metavar="MIB",
        convert=lambda mb: int(mb * MiB),
    )
    max_replies_bytes: int = option(
        "--max-replies-mb",
        "MiB of NeMo Gym reply bodies read at once, all calls together (at least "
        "--max-reply-mb): a reply waits for room before its body is read, inside its item's "
        "deadline (each reserves its Content-Length, or --max-reply-mb without one)",
        type=positive_float,
        default=DEFAULT_MAX_REPLIES_BYTES / MiB,
        metavar="MIB",
        convert=lambda mb: int(mb * MiB),
    )
    grace: float = option(
        "--grace",
        "seconds in-flight calls get to finish on SIGTERM/SIGINT",
        type=non_negative_float,
        default=10.0,
        metavar="SECONDS",
    )
    handshake_timeout: float = option(
        "--handshake-timeout",
        "seconds a client connection gets to finish its TLS and HTTP/2 handshake before it "
        "is closed (gRPC's own default: 120)",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
    )
    max_connections: int = option(
        "--max-connections",
        "most client connections open at once, handshaking or not; one more is closed as it "
        "comes (each holds a file descriptor: keep it under the process's limit)",
        type=positive_int,
        default=1024,
        metavar="N",
    )
    max_connection_age: float = option(
        "--max-connection-age",
        "seconds before a client connection is asked to reconnect, so long-lived clients "
        "rebalance across replicas; 0 = never",
        type=non_negative_float,
        default=0.0,
        metavar="SECONDS",
    )
    tls_cert: Path | None = option(
        "--tls-cert", "PEM certificate chain (with --tls-key)", type=readable_file, metavar="PATH"
    )
    tls_key: Path | None = option(
        "--tls-key", "PEM private key (TLS)", type=readable_file, metavar="PATH"
    )
    tls_client_ca: Path | None = option(
        "--tls-client-ca",
        "PEM CA bundle; require client certificates (mTLS)",
        type=readable_file,
        metavar="PATH",
    )
    token: str | None = option(
        "--token-file",
        "file holding the bearer token clients must send (the variable holds the token itself)",
        type=token_file,
        env=TOKEN_ENV,
        env_type=str,
        metavar="PATH",
    )
    insecure: bool = option(
        "--insecure",
        "allow a non-loopback --listen without TLS or a token",
        default=False,
        kind="switch",
    )
    ready_file: Path | None = option(
        "--ready-file", "write the bound HOST:PORT here once serving", type=Path, metavar="PATH"
    )
    exit_with_parent: bool = option(
        "--exit-with-parent",
        "stop when the process that started the bridge exits (embedded use)",
        default=False,
        kind="switch",
    )
    health_interval: float = option(
        "--health-interval",
        "seconds between readiness probes of the upstreams",
        type=positive_float,
        default=5.0,
        metavar="SECONDS",
    )
    metrics_port: int | None = option(
        "--metrics-port",
        "serve Prometheus metrics at http://HOST:PORT/metrics (with --workers N, worker i "
        "uses PORT+i; 0 = a free port, logged); default: no metrics server",
        type=port,
        metavar="PORT",
    )
    metrics_host: str = option(
        "--metrics-host", "address of the metrics server", default="127.0.0.1", metavar="HOST"
    )
    # Set by `serve --workers N` for its workers: several processes bind the same port, and
    # each one's limiters are one of N per bridge (`sharing_bridges` times N).
    reuse_port: bool = False
    share_factor: int = 1

    @classmethod
    def flags(cls) -> list[Flag]:
        """The flags that set the fields, in field order."""
        return [flag for f in dataclasses.fields(cls) for flag in f.metadata.get("flags", ())]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BridgeConfig:
        """The config from parsed flags: `args` holds every flag of `flags()` by its `dest`
        (`flags.resolve` fills those not given). Fields without a flag keep their default.

        Raises:
            AttributeError: a flag is missing from `args`.
        """
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if "flags" in f.metadata:
                given = (getattr(args, flag.dest) for flag in f.metadata["flags"])
                values[f.name] = f.metadata["convert"](*given)
        return cls(**values)
