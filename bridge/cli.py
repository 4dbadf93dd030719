"""Command line: `nemo-gym-grpc serve ...` (also `python -m nemo_gym_grpc.bridge serve ...`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

from pythonjsonlogger.json import JsonFormatter

from nemo_gym_grpc.bridge.server import BridgeConfig, check_exposure, check_limits, run
from nemo_gym_grpc.bridge.verifier import RetryPolicy
from nemo_gym_grpc.bridge.workers import run_workers
from nemo_gym_grpc.rewards.score import (
    add_score_command,
    non_negative_float,
    positive_float,
    positive_int,
    run_score,
)

TOKEN_ENV = "NEMO_GYM_GRPC_TOKEN"


def _server_entry(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    parts = urlsplit(url)
    if not sep or not name or parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected NAME=http://HOST:PORT, got {text!r}")
    return name, url.rstrip("/")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return port


def _listen(text: str) -> str:
    """HOST:PORT with a port 0-65535 ([IPv6]:PORT), or unix:PATH, as gRPC binds it."""
    if text.startswith("unix:"):
        return text
    host, _, port = text.rpartition(":")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        host = ""  # an IPv6 address needs brackets
    if host in ("", "[]") or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with a port 0-65535 (IPv6 as [::1]:PORT), got {text!r}"
        )
    return text


def _token_file(text: str) -> str:
    """The token held in file `text`, stripped."""
    try:
        token = Path(text).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(
            f"cannot read {text}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    if not token:
        raise argparse.ArgumentTypeError(f"{text} is empty")
    return token


def _replicas(entries: list[tuple[str, str]]) -> dict[str, list[str]]:
    """`--server` entries grouped by name: {name: [base URL, ...]} in the order given."""
    grouped: dict[str, list[str]] = {}
    for name, url in entries:
        grouped.setdefault(name, []).append(url)
    return grouped


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (subcommand `serve`)."""
    parser = argparse.ArgumentParser(prog="nemo-gym-grpc", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser(
        "serve", help="run the gRPC bridge in front of NeMo Gym resources servers"
    )
    serve_cmd.add_argument(
        "--listen",
        type=_listen,
        default="127.0.0.1:50051",
        help="gRPC host:port (default %(default)s)",
    )
    serve_cmd.add_argument(
        "--head-url",
        help="NeMo Gym head server URL, e.g. http://127.0.0.1:11000, to discover servers",
    )
    serve_cmd.add_argument(
        "--server",
        action="append",
        default=[],
        type=_server_entry,
        metavar="NAME=URL",
        help="a resources server base URL (repeatable; the same NAME again adds a replica, "
        "load goes to the least busy one); wins over discovery",
    )
    serve_cmd.add_argument(
        "--session-server",
        action="append",
        default=[],
        metavar="NAME",
        help="run every item of this resources server as its own NeMo Gym session: "
        "/seed_session first, its cookies sent with the item's /verify (repeatable)",
    )
    serve_cmd.add_argument(
        "--verify-timeout",
        type=positive_float,
        default=30.0,
        help="default seconds per upstream /verify call (default %(default)s)",
    )
    serve_cmd.add_argument(
        "--max-in-flight",
        type=positive_int,
        default=256,
        help="most concurrent /verify calls per upstream (default %(default)s)",
    )
    serve_cmd.add_argument(
        "--retry-attempts",
        type=positive_int,
        default=3,
        help="most attempts per item for transient causes (connection errors, HTTP "
        "500/502/503/504/429), the first included (default %(default)s; 1 = no retries)",
    )
    serve_cmd.add_argument(
        "--retry-budget",
        type=non_negative_float,
        default=60.0,
        help="most seconds from an item's first attempt to the start of its last "
        "(default %(default)s)",
    )
    serve_cmd.add_argument(
        "--max-stream-items",
        type=positive_int,
        default=4096,
        help="most items one VerifyStream holds at once (default %(default)s)",
    )
    serve_cmd.add_argument(
        "--max-batch-items",
        type=positive_int,
        default=None,
        help="most items in one VerifyStreamRequest message, at most --max-stream-items "
        "(default: the same as --max-stream-items)",
    )
    serve_cmd.add_argument(
        "--max-item-mb",
        type=positive_float,
        default=16.0,
        help="largest item in MiB; a larger one fails alone with INVALID_ARGUMENT "
        "(default %(default)s)",
    )
    serve_cmd.add_argument(
        "--max-streams",
        type=positive_int,
        default=256,
        help="most concurrent VerifyStream calls (default %(default)s)",
    )
    serve_cmd.add_argument(
        "--max-message-mb",
        type=positive_int,
        default=64,
        help="gRPC message size limit in MiB, both directions (default %(default)s)",
    )
    serve_cmd.add_argument(
        "--grace",
        type=non_negative_float,
        default=10.0,
        help="shutdown grace seconds (default %(default)s)",
    )
    serve_cmd.add_argument(
        "--max-connection-age",
        type=non_negative_float,
        default=0.0,
        help="seconds before a client connection is asked to reconnect, so long-lived "
        "clients rebalance across replicas (default 0 = never)",
    )
    serve_cmd.add_argument("--tls-cert", type=Path, help="PEM certificate chain (TLS)")
    serve_cmd.add_argument("--tls-key", type=Path, help="PEM private key (TLS)")
    serve_cmd.add_argument(
        "--tls-client-ca", type=Path, help="PEM CA bundle; require client certificates (mTLS)"
    )
    serve_cmd.add_argument(
        "--token-file",
        type=_token_file,
        help=f"file holding the bearer token clients must send (else env {TOKEN_ENV})",
    )
    serve_cmd.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --listen without TLS or a token",
    )
    serve_cmd.add_argument(
        "--ready-file", type=Path, help="write the bound host:port here once serving"
    )
    serve_cmd.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started the bridge exits (embedded use)",
    )
    serve_cmd.add_argument(
        "--health-interval",
        type=positive_float,
        default=5.0,
        help="seconds between readiness probes of the upstreams (default %(default)s)",
    )
    serve_cmd.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="bridge processes sharing the port via SO_REUSEPORT, one per core "
        "(default %(default)s)",
    )
    serve_cmd.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (with --workers N, worker "
        "i uses PORT+i; 0 = a free port, logged); default: no metrics server",
    )
    serve_cmd.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address of the metrics server (default %(default)s)",
    )
    serve_cmd.add_argument("--log-level", default="INFO", help="logging level")
    serve_cmd.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="text lines, or one JSON object per line for log collectors (default %(default)s)",
    )
    add_score_command(commands)
    return parser


def _token(from_file: str | None) -> str | None:
    return from_file or os.environ.get(TOKEN_ENV, "").strip() or None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `nemo-gym-grpc` console script. Returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "score":
        return run_score(args)
    handler = logging.StreamHandler(sys.stderr)
    if args.log_format == "json":
        handler.setFormatter(
            JsonFormatter("%(asctime)s %(levelname)s %(name)s %(process)d %(message)s")
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    if args.max_item_mb > args.max_message_mb:
        logging.getLogger(__name__).warning(
            "--max-item-mb %s exceeds --max-message-mb %s: items that large cannot arrive",
            args.max_item_mb,
            args.max_message_mb,
        )
    if not args.head_url and not args.server:
        logging.getLogger(__name__).warning(
            "no --head-url and no --server: every item will fail with NOT_FOUND"
        )
    config = BridgeConfig(
        listen=args.listen,
        head_url=args.head_url,
        servers=_replicas(args.server),
        session_servers=tuple(args.session_server),
        verify_timeout=args.verify_timeout,
        max_in_flight=args.max_in_flight,
        retry=RetryPolicy(attempts=args.retry_attempts, budget=args.retry_budget),
        max_stream_items=args.max_stream_items,
        max_batch_items=args.max_batch_items,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        max_item_bytes=int(args.max_item_mb * 1024 * 1024),
        grace=args.grace,
        max_streams=args.max_streams,
        max_connection_age=args.max_connection_age,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        token=_token(args.token_file),
        insecure=args.insecure,
        ready_file=args.ready_file,
        exit_with_parent=args.exit_with_parent,
        health_interval=args.health_interval,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
    )
    try:
        if args.workers > 1:
            check_exposure(config)  # fail before forking
            check_limits(config)
            return run_workers(config, args.workers)
        run(config)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"nemo-gym-grpc: {exc}", file=sys.stderr)
        return 1
    return 0
