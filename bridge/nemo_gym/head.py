"""The head server's `GET /global_config_dict_yaml`: where each resources server, agent server
and environment server listens.

The reply is data from outside: it is read with a size limit and without following redirects,
parsed with PyYAML's safe loader (its C version where PyYAML has one), and every server entry
is checked before it becomes a route (`shared.addresses`): a bad entry is refused by itself, the
others still route.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import yaml

from nemo_gym_grpc.bridge.nemo_gym.http import exact_timeout, read_capped
from nemo_gym_grpc.bridge.nemo_gym.plain_http import TooLarge
from nemo_gym_grpc.shared.addresses import base_url, check_host, check_port
from nemo_gym_grpc.shared.contract import MiB

GLOBAL_CONFIG_PATH = "/global_config_dict_yaml"
# Largest head-server reply read, bytes (a config of a hundred servers is about 100 KB).
MAX_CONFIG_BYTES = 16 * MiB

# Hosts a server binds to that are not addresses to call.
_WILDCARD_HOSTS = {"0.0.0.0", "::", ""}
_SafeLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

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


class HeadUnreadable(Exception):
    """The head server's config could not be read: the GET failed (connection, timeout,
    non-200 status, a redirect, a reply over MAX_CONFIG_BYTES) or its body is not NeMo Gym's
    global config. The message says which, in one line."""


def load_config(body: bytes | str) -> dict[Any, Any]:
    """NeMo Gym's global config from a `/global_config_dict_yaml` reply body.

    The reply is double encoded: a JSON string literal whose value is the YAML text of NeMo
    Gym's global config (`OmegaConf.to_yaml`).

    Raises:
        HeadUnreadable: the body is not a JSON string, its YAML does not load with the safe
            loader (tags such as `!!python/object` are refused, never run), or is no mapping.
    """
    try:
        text = json.loads(body)
        if not isinstance(text, str):
            raise HeadUnreadable("global_config_dict_yaml reply is not a JSON string")
        config = yaml.load(text, Loader=_SafeLoader)  # noqa: S506 - a safe loader
    except (ValueError, yaml.YAMLError, RecursionError) as exc:
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        why = f"global config does not parse: {type(exc).__name__}: {first}"
        raise HeadUnreadable(why) from None
    if not isinstance(config, dict):
        raise HeadUnreadable("global config YAML is not a mapping")
    return config


@dataclass
class Listing:
    """The servers of some blocks of a global config.

    Attributes:
        found: {name: (base URL, protocol)}, e.g. {"mcqa": ("http://127.0.0.1:18001", "")}.
        refused: {name: why} of entries whose host or port is refused (`shared.addresses`).
    """

    found: dict[str, tuple[str, str]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


def list_servers(config: Mapping[Any, Any], head_url: str, blocks: Mapping[str, str]) -> Listing:
    """The servers of the kinds in `blocks` in a global config (`load_config`).

    Servers sit at `<instance>.<block>.<type>.{host,port}` (block e.g. `resources_servers`,
    `responses_api_agents`, `environment_servers`). Each is registered under its instance
    name (NeMo Gym's own routing key) and, when no other entry claims it, under `<type>` too
    (what axolotl's seed used). Wildcard hosts (0.0.0.0, ::) become the head server's host and
    `localhost` becomes 127.0.0.1. Entries without a host or port (not started) are left out.

    Args:
        blocks: {block name: protocol}; each server found is returned with its block's
            protocol (e.g. AGENT_SERVERS), except that an `environment_servers` entry of a
            type in ROW_RUN_ENVIRONMENT_SERVERS gets the `responses_api_agents` block's protocol.
    """
    head_host = urlsplit(head_url).hostname or "127.0.0.1"
    listing = Listing()
    by_type: dict[str, set[tuple[str, str]]] = {}
    for instance, server_type, route in _listed(config, blocks, head_host):
        if isinstance(route, str):
            listing.refused[instance] = route
            continue
        listing.found[instance] = route
        by_type.setdefault(server_type, set()).add(route)
    for server_type, routes in by_type.items():
        if server_type not in listing.found and server_type not in listing.refused:
            if len(routes) == 1:
                listing.found[server_type] = next(iter(routes))
    return listing


def _listed(
    config: Mapping[Any, Any], blocks: Mapping[str, str], head_host: str
) -> Iterator[tuple[str, str, tuple[str, str] | str]]:
    """(instance name, server type, (base URL, protocol) or why it is refused) of each server
    of `blocks` in the global config that has a host and a port."""
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
                if server.get("port") is None:
                    continue
                found = protocol
                if (
                    block_name == "environment_servers"
                    and server_type in ROW_RUN_ENVIRONMENT_SERVERS
                ):
                    found = blocks.get("responses_api_agents", protocol)
                yield str(instance), str(server_type), _route(server, head_host, found)


def _route(server: Mapping[Any, Any], head_host: str, protocol: str) -> tuple[str, str] | str:
    """(base URL, protocol) of one config entry, or why its address is refused."""
    host = server["host"]
    if isinstance(host, str) and host.strip("[]") in _WILDCARD_HOSTS:
        host = head_host
    if host == "localhost":
        host = "127.0.0.1"
    try:
        url = base_url(check_host(host), check_port(server["port"]))
    except ValueError as exc:
        return str(exc)
    return url, protocol


async def read_config(session: aiohttp.ClientSession, head_url: str, timeout: float) -> bytes:
    """GET the head server's `/global_config_dict_yaml` body (redirects are not followed).

    Args:
        head_url: the head server's base URL, no trailing slash.
        timeout: seconds for the request.

    Raises:
        HeadUnreadable: no 200 reply within `timeout`, a 3xx (naming where it pointed), or a
            body over MAX_CONFIG_BYTES.
    """
    url = f"{head_url}{GLOBAL_CONFIG_PATH}"
    try:
        async with session.get(url, timeout=exact_timeout(timeout), allow_redirects=False) as reply:
            if 300 <= reply.status < 400:
                where = reply.headers.get("Location", "")[:200]
                raise HeadUnreadable(f"{url} answered {reply.status}, a redirect to {where!r}")
            reply.raise_for_status()
            return await read_capped(reply, MAX_CONFIG_BYTES)
    except (aiohttp.ClientError, TimeoutError, TooLarge) as exc:
        raise HeadUnreadable(f"{type(exc).__name__}: {exc}") from exc
