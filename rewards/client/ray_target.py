"""The target `ray:`: the bridges of the Ray cluster this process belongs to, its own node's
first (NEMO_GYM_GRPC_TARGET=ray:, or `target="ray:"`).

The fleet (`python -m nemo_gym_grpc.bridge.ray start`, or `start_bridges` from a driver) runs
one bridge per node and registers each in a named Ray actor. `resolve("ray:")` reads that
table and gives the gRPC target `ipv4:OWN:PORT,NEXT:PORT,...`: this process's node's bridge
first, then the others in node order starting after it (so the nodes' fallbacks spread). The
channel for it uses gRPC's `pick_first` policy (PICK_FIRST): every call goes to the first
address that accepts a connection, i.e. the node's own bridge while it is up and the next
one while it is not, and back to the own one once it is up again (gRPC reconnects from the
start of the list when the connection it used breaks).

Where Ray comes from: inside a Ray worker, actor or driver, the cluster it is part of; in a
process that has not joined Ray (a TRL trainer on a Ray node), `ray:` joins the cluster as a
driver (`ray.init(address="auto")`: env RAY_ADDRESS, else the cluster this node runs). The
table is read at most every CACHE_SECONDS per process; the own node is the one on this host's
address (`own_node`). Needs the `[ray]` extra.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

from nemo_gym_grpc.rewards.client.per_process import PerProcess

PREFIX = "ray:"
# The fleet's Ray namespace and registry actor (nemo_gym_grpc.bridge.ray.fleet, which this
# side must not import); tests/test_ray_fleet.py checks that the two agree.
NAMESPACE = "nemo_gym_grpc"
REGISTRY_NAME = "registry"
CACHE_SECONDS = 10.0
LOOKUP_TIMEOUT = 30.0  # seconds to read the registry
PICK_FIRST = json.dumps({"loadBalancingConfig": [{"pick_first": {}}]})

_cache: PerProcess[str, tuple[float, str]] = PerProcess()
_init_lock = threading.Lock()


def is_ray(target: str | None) -> bool:
    """Whether `target` is the Ray form (`ray:`)."""
    return target is not None and target.strip() == PREFIX


def order(table: dict[str, dict[str, Any]], own_node: str) -> list[str]:
    """The bridges' "host:port" targets, `own_node`'s first, then the others in node-id order
    from the one after it. A node without a bridge starts the rotation where it would be."""
    nodes = sorted(table)
    start = sum(1 for node in nodes if node < own_node)
    if own_node in table:
        start = nodes.index(own_node)
    rotated = nodes[start:] + nodes[:start]
    return [table[node]["target"] for node in rotated]


def grpc_target(addresses: list[str]) -> str:
    """`ipv4:A:P,B:P` (or `ipv6:[A]:P,...` when every host is IPv6) for "host:port" targets.

    Raises:
        ValueError: no addresses, or IPv4 and IPv6 mixed (one gRPC target holds one family).
    """
    if not addresses:
        raise ValueError(
            "NEMO_GYM_GRPC_TARGET=ray: the Ray cluster has no bridges: start them with "
            "`python -m nemo_gym_grpc.bridge.ray start -- ...` (docs/operating.md)"
        )
    split = [a.rsplit(":", 1) for a in addresses]
    v6 = [":" in host for host, _ in split]
    if all(v6):
        return "ipv6:" + ",".join(f"[{host.strip('[]')}]:{port}" for host, port in split)
    if any(v6):
        raise ValueError(f"ray: bridges on both IPv4 and IPv6 addresses: {addresses}")
    return "ipv4:" + ",".join(addresses)


def home(target: str) -> str:
    """The first ("own") address of a target `grpc_target` made, as "host:port"."""
    first = target.split(":", 1)[1].split(",", 1)[0]
    return first


def _connected_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError(
            "NEMO_GYM_GRPC_TARGET=ray: needs Ray, the [ray] extra: pip install '.[ray]' in a "
            "clone of nemo-gym-grpc"
        ) from None
    with _init_lock:
        if not ray.is_initialized():
            ray.init(address="auto", log_to_driver=False)
    return ray


def local_address(towards: str) -> str | None:
    """This host's address on the route to "host:port" `towards` (the local end of a UDP
    socket connected there; nothing is sent), or None if there is no route."""
    host = towards.rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            address: str = probe.getsockname()[0]
            return address
    except OSError:
        return None


def own_node(ray: Any, nodes: dict[str, str]) -> str:
    """This process's node among `nodes` {node id: address}: the one node on this host's
    address (towards the cluster's GCS), else the node Ray attached this process to.

    A worker's runtime context names its node; a driver's names the node Ray attached it to,
    found by listing the host's raylet processes, which on hosts sharing one process table
    (containers in one pod, network namespaces) can be another host's: the address decides."""
    context = ray.get_runtime_context()
    address = local_address(context.gcs_address)
    mine = [node for node, at in nodes.items() if at == address]
    return mine[0] if len(mine) == 1 else str(context.get_node_id())


def resolve(target: str) -> str:
    """The gRPC target for `ray:` (module docstring), read from the cluster at most every
    CACHE_SECONDS; any other `target` is returned as it is.

    Raises:
        ValueError: Ray is not installed, or the cluster has no bridges.
        ConnectionError: no Ray cluster to join (from `ray.init`).
        ray.exceptions.GetTimeoutError: the registry did not answer within LOOKUP_TIMEOUT s.
    """
    if not is_ray(target):
        return target
    now = time.monotonic()
    with _cache.lock:
        cached = _cache.entries.get(PREFIX)
    if cached is not None and now - cached[0] < CACHE_SECONDS:
        return cached[1]
    ray = _connected_ray()
    try:
        registry = ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)
    except ValueError:
        table: dict[str, dict[str, Any]] = {}
    else:
        table = ray.get(registry.table.remote(), timeout=LOOKUP_TIMEOUT)
    nodes = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
    table = {node: entry for node, entry in table.items() if node in nodes}
    resolved = grpc_target(order(table, own_node(ray, nodes)))
    with _cache.lock:
        _cache.entries[PREFIX] = (now, resolved)
    return resolved


def forget() -> None:
    """Drop the cached table (the next `resolve` reads the registry again)."""
    with _cache.lock:
        _cache.entries.clear()
