"""The checks that refuse unsafe or contradictory bridge settings (`BridgeConfig`) before
anything starts: `nemo-gym-grpc serve` runs them before it forks its workers, `server.serve`
again before it binds."""

from __future__ import annotations

import ipaddress
import ssl

from nemo_gym_grpc.bridge.process.config import BridgeConfig
from nemo_gym_grpc.shared.contract import TOKEN_ENV, MiB


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


def check_tls(config: BridgeConfig) -> None:
    """Refuse TLS files that cannot serve: half a pair, a client CA without one, or files that
    `ssl` (OpenSSL, as gRPC's) cannot load as a PEM chain with its key or as a CA bundle.

    Raises:
        ValueError: naming the flags (and what `ssl` said).
    """
    cert, key, ca = config.tls_cert, config.tls_key, config.tls_client_ca
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together")
    if ca and not cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    flags, what = f"--tls-cert {cert} / --tls-key {key}", "a PEM chain and its unencrypted key"
    try:
        if cert and key:
            context.load_cert_chain(cert, key, password=b"")  # no prompt: gRPC takes none
        flags, what = f"--tls-client-ca {ca}", "a PEM CA bundle"
        if ca:
            context.load_verify_locations(cafile=ca)
    except (ssl.SSLError, ValueError) as exc:
        raise ValueError(f"{flags}: not {what} ({exc})") from None


def check_exposure(config: BridgeConfig) -> None:
    """Refuse a non-loopback listen address with neither TLS nor a token, unless insecure.

    Raises:
        ValueError: naming the address and the flags that allow it.
    """
    if is_loopback(config.listen) or config.tls_cert or config.token or config.insecure:
        return
    raise ValueError(
        f"refusing to listen on non-loopback {config.listen} without TLS or a token: "
        f"set --tls-cert/--tls-key and/or --token-file (or {TOKEN_ENV}), or pass --insecure"
    )


def check_limits(config: BridgeConfig) -> None:
    """Refuse limits that contradict each other.

    Raises:
        ValueError: a limit below 1, `max_batch_items` over `max_stream_items` (a message
            is parsed whole, so a bigger one would break the bound on items held per stream),
            `--max-replies-mb` below `--max-reply-mb`, a name given both to `--agent` and
            `--environment-server`, or `--sharing-bridges` (other than 1) or
            `--sharing-bridges-file` with `--fixed-concurrency`, which has no limit to share.
    """
    both = sorted(set(config.agents) & set(config.environment_servers))
    if both:
        raise ValueError(
            f"{', '.join(both)}: given to both --agent and --environment-server; a name "
            "routes to one protocol"
        )
    for flag, value in (
        ("--max-stream-items", config.max_stream_items),
        ("--max-batch-items", config.max_batch_items),
        ("--max-in-flight", config.max_in_flight),
        ("--fixed-concurrency", config.fixed_concurrency),
        ("--max-streams", config.max_streams),
        ("--agent-concurrency", config.agent_concurrency),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if config.fixed_concurrency is not None and (
        config.sharing_bridges != 1 or config.sharing_bridges_file is not None
    ):
        raise ValueError(
            "--sharing-bridges and --sharing-bridges-file share the adaptive limit's standing "
            "queue; with --fixed-concurrency there is none: leave them out"
        )
    if config.max_replies_bytes < config.max_reply_bytes:
        raise ValueError(
            f"--max-replies-mb {config.max_replies_bytes / MiB:g} is below --max-reply-mb "
            f"{config.max_reply_bytes / MiB:g}: the reply bytes read at once must hold one "
            "reply of the largest size"
        )
    if config.max_batch_items is not None and config.max_batch_items > config.max_stream_items:
        raise ValueError(
            f"--max-batch-items {config.max_batch_items} exceeds --max-stream-items "
            f"{config.max_stream_items}: a message is parsed whole, so it may not hold more "
            "items than a stream holds at once"
        )
