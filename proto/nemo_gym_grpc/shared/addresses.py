"""What the host and port of a NeMo Gym server may be, wherever they come from: a head server's
config entry (`bridge/nemo_gym/head.py`) or a flag or variable naming an upstream
(`flags.http_url`, `flags.server_entry`). One rule, so a URL refused in one place is refused
in the other."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

# A DNS name: dot-separated labels of letters, digits, '-' and '_' (container and k8s names).
_HOSTNAME = re.compile(
    r"(?=.{1,253}\Z)[A-Za-z0-9_][A-Za-z0-9_-]{0,62}(\.[A-Za-z0-9_-]{1,63})*\.?\Z"
)


def check_host(host: Any) -> str:
    """`host` when it is an IP address (IPv6 with or without brackets) or a DNS name and
    nothing else (no scheme, path, user or port in it), without brackets.

    Raises:
        ValueError: saying what is wrong.
    """
    if not isinstance(host, str):
        raise ValueError(f"host {str(host)[:40]!r} is not a text")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    if not _HOSTNAME.match(bare):
        raise ValueError(f"host {host[:60]!r} is not an IP address or a DNS name")
    return bare


def check_port(port: Any) -> int:
    """`port` as an integer 1-65535 (digits in a string count).

    Raises:
        ValueError: saying what is wrong.
    """
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port {str(port)[:40]!r} is not an integer 1-65535")
    return port


def base_url(host: str, port: int, scheme: str = "http") -> str:
    """`scheme://host:port` for a checked host (IPv6 in brackets)."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
