"""Start, list and stop the fleet: one `BridgeActor` per alive node of the current Ray cluster.

Functions here need a connected Ray (`ray.init(...)` done, or run inside a Ray worker); the
command line (`__main__.py`) connects first. Actors live in the Ray namespace NAMESPACE,
detached (they outlive the driver that started them), the bridge of node N named
`bridge-<N's node id>`, the registry REGISTRY_NAME.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from nemo_gym_grpc.bridge.ray.actors import BridgeActor, Registry

NAMESPACE = "nemo_gym_grpc"
REGISTRY_NAME = "registry"
DEFAULT_PORT = 50051
STOP_GRACE = 30.0  # seconds each bridge gets to drain when the fleet stops
# Flags the fleet sets itself on every bridge (listen on the node's address at the fleet's
# port, one worker per CPU the actor holds, ready file, stop with the actor, and unless the
# caller sets --sharing-bridges the file its actor writes the fleet's size into).
OWN_FLAGS = (
    "--listen", "--workers", "--ready-file", "--exit-with-parent", "--sharing-bridges-file"
)  # fmt: skip

log = logging.getLogger(__name__)


def bridge_name(node_id: str) -> str:
    """The Ray actor name of node `node_id`'s bridge."""
    return f"bridge-{node_id}"


def _registry() -> Any:
    """The registry actor, created (detached, no CPU, restarted forever) if there is none."""
    actor = ray.remote(Registry).options(
        name=REGISTRY_NAME,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,
        max_task_retries=-1,
    )
    return actor.remote()


def _check_flags(serve_args: Sequence[str]) -> None:
    for arg in serve_args:
        if arg.split("=", 1)[0] in OWN_FLAGS:
            raise ValueError(f"{arg}: the fleet sets {', '.join(OWN_FLAGS)} itself")


def _sets_share(serve_args: Sequence[str]) -> bool:
    """Whether `serve_args` leave the fleet no share to set: they give `--sharing-bridges`,
    or `--fixed-concurrency` (no adaptive limit, no standing queue to share)."""
    own = ("--sharing-bridges", "--fixed-concurrency")
    return any(arg.split("=", 1)[0] in own for arg in serve_args)


def with_share(serve_args: Sequence[str], nodes: int) -> list[str]:
    """`serve_args` with `--sharing-bridges NODES` unless they set it: the bridges of `nodes`
    nodes call the same NeMo Gym servers, so each keeps its share of the standing queue
    the adaptive limits aim for at a server (`flows/limits.py`)."""
    if _sets_share(serve_args):
        return list(serve_args)
    return [*serve_args, "--sharing-bridges", str(max(1, nodes))]


def start_bridges(
    serve_args: Sequence[str] = (),
    *,
    port: int = DEFAULT_PORT,
    cpus: float = 1.0,
    max_restarts: int = -1,
    startup_timeout: float = 120.0,
    nodes: Sequence[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Start a bridge on every alive node that has none yet, and wait until each serves.

    Args:
        serve_args: `nemo-gym-grpc serve` flags for every bridge (e.g. `--head-url URL`,
            `--token-file PATH`, `--server NAME=URL`); not those of OWN_FLAGS. A bridge
            listens on its node's address, so the bridge refuses to start without TLS, a
            token or `--insecure` (its own rule). `--sharing-bridges` is the number of the
            fleet's bridges once these are started unless given (`with_share`); then every
            bridge follows the registry's count as the fleet grows (`BridgeActor`).
        port: the TCP port every bridge listens on (the same on every node, so a restarted
            bridge keeps its address).
        cpus: CPUs each bridge actor holds; its `--workers` is that number rounded down, at
            least 1.
        max_restarts: how often Ray restarts a bridge that died (-1: without limit).
        startup_timeout: seconds each bridge may take to serve.
        nodes: the Ray node ids to start bridges on (default: every alive node).

    Returns:
        The registry table {node id: entry} (`BridgeActor.entry`).

    Raises:
        ValueError: `serve_args` holds one of OWN_FLAGS.
        ray.exceptions.RayActorError: a bridge did not start (its output in the message).
    """
    _check_flags(serve_args)
    _registry()
    targets = [
        node["NodeID"]
        for node in ray.nodes()  # type: ignore[no-untyped-call]
        if node["Alive"] and (nodes is None or node["NodeID"] in nodes)
    ]
    follow_share = not _sets_share(serve_args)
    serve_args = with_share(serve_args, len(set(bridge_table()) | set(targets)))
    started: list[tuple[Any, Any]] = []  # (actor handle, its `entry` call)
    for node_id in targets:
        actor = ray.remote(BridgeActor).options(
            name=bridge_name(node_id),
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=cpus,
            max_restarts=max_restarts,
            max_task_retries=-1 if max_restarts else 0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        handle: Any = actor.remote(
            list(serve_args),
            port,
            max(1, int(cpus)),
            REGISTRY_NAME,
            NAMESPACE,
            startup_timeout,
            follow_share,
        )
        started.append((handle, handle.entry.remote()))
    _await_started(started)
    return bridge_table()


def _await_started(started: list[tuple[Any, Any]]) -> None:
    """Wait until every bridge serves or failed; end the failed ones (their names free again
    for the next `start`) and raise the first failure."""
    failures = []
    for handle, entry in started:
        try:
            log.info("bridge on %s", ray.get(entry)["target"])
        except ray.exceptions.RayError as exc:
            ray.kill(handle, no_restart=True)
            failures.append(exc)
    if failures:
        raise failures[0]


def bridge_table() -> dict[str, dict[str, Any]]:
    """The registry table {node id: entry}; {} when no fleet was started."""
    try:
        registry = ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)
    except ValueError:
        return {}
    table: Any = ray.get(registry.table.remote())
    return dict(table)


def stop_bridges(grace: float = STOP_GRACE) -> int:
    """Drain and end every bridge of the fleet (each gets `grace` s), then the registry.
    Returns how many bridges were stopped."""
    stopped = 0
    names = ray.util.list_named_actors(all_namespaces=True)
    for name in sorted(n["name"] for n in names if n["namespace"] == NAMESPACE):
        if not name.startswith(bridge_name("")):
            continue
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue
        try:
            ray.get(actor.stop.remote(grace), timeout=grace + 30)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("%s did not drain: %s", name, exc)
        ray.kill(actor, no_restart=True)
        stopped += 1
    try:
        ray.kill(ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE), no_restart=True)
    except ValueError:
        pass
    return stopped
