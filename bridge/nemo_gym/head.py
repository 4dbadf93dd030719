"""The head server's `GET /global_config_dict_yaml`: where each resources server, agent server
and environment server listens."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import yaml

from nemo_gym_grpc.bridge.nemo_gym.http import exact_timeout

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


# The protocols the bridge speaks to a server found in the head server's config: "" for a
# resources server, AGENT (a flat row to `/run`, `run.py`) or ENVIRONMENT (an episode to
# `/run`, `episodes.py`).
AGENT = "agent"
ENVIRONMENT = "environment"
# Head-server config blocks -> the protocol of the servers found there.
RESOURCES_SERVERS = {"resources_servers": ""}
AGENT_SERVERS = {"responses_api_agents": AGENT, "environment_servers": ENVIRONMENT}
# Environment server types whose `/run` takes a flat row, as an agent's does (0.7's relay to an
# unmigrated agent, and the flat-row adapter of single_agent_turn); found by type name.
ROW_RUN_ENVIRONMENT_SERVERS = frozenset({"legacy_agent", "single_agent_turn_legacy"})


def parse_servers(
    body: bytes | str, head_url: str, blocks: Mapping[str, str]
) -> dict[str, tuple[str, str]]:
    """The servers of the kinds in `blocks` in the head server's `/global_config_dict_yaml`
    reply.

    The reply is double encoded: a JSON string literal whose value is the YAML text of NeMo
    Gym's global config (`OmegaConf.to_yaml`). Servers sit at
    `<instance>.<block>.<type>.{host,port}` (block e.g. `resources_servers`,
    `responses_api_agents`, `environment_servers`). Each is registered under its instance
    name (NeMo Gym's own routing key) and, when no other entry claims it, under `<type>` too
    (what axolotl's seed used). Wildcard hosts (0.0.0.0, ::) become the head server's host and
    `localhost` becomes 127.0.0.1.

    Args:
        blocks: {block name: protocol}; each server found is returned with its block's
            protocol (e.g. AGENT_SERVERS), except that an `environment_servers` entry of a
            type in ROW_RUN_ENVIRONMENT_SERVERS gets the `responses_api_agents` block's protocol.

    Returns:
        {name: (base URL, protocol)}, e.g. {"mcqa": ("http://127.0.0.1:18001", "")}.

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
    by_instance: dict[str, tuple[str, str]] = {}
    by_type: dict[str, set[tuple[str, str]]] = {}
    for instance, server_type, route in _listed(config, blocks, head_host):
        by_instance[instance] = route
        by_type.setdefault(server_type, set()).add(route)
    found = dict(by_instance)
    for server_type, routes in by_type.items():
        if server_type not in found and len(routes) == 1:
            found[server_type] = next(iter(routes))
    return found


def _listed(
    config: dict[Any, Any], blocks: Mapping[str, str], head_host: str
) -> Iterator[tuple[str, str, tuple[str, str]]]:
    """(instance name, server type, (base URL, protocol)) of each server of `blocks` in the
    global config that has a host and a port."""
    for instance, block in config.items():
        if not isinstance(block, dict):
            continue
        for block_name, protocol in blocks.items():
            servers = block.get(block_name)
            if not isinstance(servers, dict):
                continue
            for server_type, server in servers.items():
                if not isinstance(server, dict) or server.get("host") is None:
                    continue
                if not server.get("port"):
                    continue
                found = protocol
                if (
                    block_name == "environment_servers"
                    and server_type in ROW_RUN_ENVIRONMENT_SERVERS
                ):
                    found = blocks.get("responses_api_agents", protocol)
                url = _base_url(server["host"], server["port"], head_host)
                yield str(instance), str(server_type), (url, found)


def parse_global_config(body: bytes | str, head_url: str) -> dict[str, str]:
    """The resources servers in a `/global_config_dict_yaml` reply (see `parse_servers`):
    {name: base URL}, e.g. {"mcqa": "http://127.0.0.1:18001"}. Raises ValueError as it."""
    found = parse_servers(body, head_url, RESOURCES_SERVERS)
    return {name: url for name, (url, _) in found.items()}


async def global_servers(
    session: aiohttp.ClientSession, head_url: str, timeout: float, blocks: Mapping[str, str]
) -> dict[str, tuple[str, str]]:
    """GET the head server's `/global_config_dict_yaml` and parse the servers of `blocks`
    from it (`parse_servers`).

    Args:
        head_url: the head server's base URL, no trailing slash.
        timeout: seconds for the request.

    Raises:
        aiohttp.ClientError (a non-200 status included), TimeoutError, ValueError.
    """
    async with session.get(
        f"{head_url}{GLOBAL_CONFIG_PATH}", timeout=exact_timeout(timeout)
    ) as reply:
        reply.raise_for_status()
        body = await reply.read()
    return parse_servers(body, head_url, blocks)
