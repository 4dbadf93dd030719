"""The head server's `GET /global_config_dict_yaml`: where each resources server listens."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import yaml

GLOBAL_CONFIG_PATH = "/global_config_dict_yaml"

# Hosts a server binds to that are not addresses to call.
_WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


def _base_url(host: str, port: int | str, head_host: str) -> str:
    host = str(host).strip("[]")
    if host in _WILDCARD_HOSTS:
        host = head_host
    if host == "localhost":
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{int(port)}"


def parse_global_config(body: bytes | str, head_url: str) -> dict[str, str]:
    """Resources servers in the head server's `/global_config_dict_yaml` reply.

    The reply is double encoded: a JSON string literal whose value is the YAML text of NeMo
    Gym's global config (`OmegaConf.to_yaml`). Resources servers sit at
    `<instance>.resources_servers.<type>.{host,port}`. Each is registered under its instance
    name (NeMo Gym's own routing key) and, when no other entry claims it, under `<type>` too
    (what axolotl's seed used). Wildcard hosts (0.0.0.0, ::) become the head server's host and
    `localhost` becomes 127.0.0.1.

    Returns:
        {name: base URL}, e.g. {"mcqa": "http://127.0.0.1:18001"}.

    Raises:
        ValueError: the body is not a JSON string or YAML mapping of that shape.
    """
    text = json.loads(body)
    if not isinstance(text, str):
        raise ValueError("global_config_dict_yaml reply is not a JSON string")
    config: Any = yaml.safe_load(text)
    if not isinstance(config, dict):
        raise ValueError("global config YAML is not a mapping")
    head_host = urlsplit(head_url).hostname or "127.0.0.1"
    by_instance: dict[str, str] = {}
    by_type: dict[str, set[str]] = {}
    for instance, block in config.items():
        servers = block.get("resources_servers") if isinstance(block, dict) else None
        if not isinstance(servers, dict):
            continue
        for server_type, server in servers.items():
            if isinstance(server, dict) and server.get("host") is not None and server.get("port"):
                url = _base_url(server["host"], server["port"], head_host)
                by_instance[str(instance)] = url
                by_type.setdefault(str(server_type), set()).add(url)
    found = dict(by_instance)
    for server_type, urls in by_type.items():
        if server_type not in found and len(urls) == 1:
            found[server_type] = next(iter(urls))
    return found


async def global_config(
    session: aiohttp.ClientSession, head_url: str, timeout: float
) -> dict[str, str]:
    """GET the head server's `/global_config_dict_yaml` and parse it (`parse_global_config`).

    Args:
        head_url: the head server's base URL, no trailing slash.
        timeout: seconds for the request.

    Raises:
        aiohttp.ClientError (a non-200 status included), TimeoutError, ValueError.
    """
    async with session.get(
        f"{head_url}{GLOBAL_CONFIG_PATH}", timeout=aiohttp.ClientTimeout(total=timeout)
    ) as reply:
        reply.raise_for_status()
        body = await reply.read()
    return parse_global_config(body, head_url)
