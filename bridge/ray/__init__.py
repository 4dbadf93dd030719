"""A bridge on every node of a Ray cluster (the `[ray]` extra: `pip install '.[ray]'`).

    python -m nemo_gym_grpc.bridge.ray start -- --head-url http://10.0.0.1:11000 --token-file T
    python -m nemo_gym_grpc.bridge.ray status
    python -m nemo_gym_grpc.bridge.ray stop

or, from a Ray driver (a trainer's), `start_bridges([...serve flags...])`. Each alive node gets
one `BridgeActor` (`actors.py`), pinned to it (node affinity), which runs `nemo-gym-grpc serve`
as a child process listening on the node's address at one fixed port, with `--workers` = the
CPUs the actor holds. Ray restarts an actor that dies (`max_restarts`), and an actor dies with
its bridge. Every bridge is registered by node in a named, detached `Registry` actor, which the
trainer side reads for the target `ray:` (`nemo_gym_grpc.rewards`; docs/operating.md, Scaling
out). This package never imports the trainer side.
"""

from typing import TYPE_CHECKING

from nemo_gym_grpc.shared.lazy import exports

if TYPE_CHECKING:  # the same names, for type checkers (the `as` marks a re-export)
    from nemo_gym_grpc.bridge.ray.fleet import DEFAULT_PORT as DEFAULT_PORT
    from nemo_gym_grpc.bridge.ray.fleet import NAMESPACE as NAMESPACE
    from nemo_gym_grpc.bridge.ray.fleet import REGISTRY_NAME as REGISTRY_NAME
    from nemo_gym_grpc.bridge.ray.fleet import bridge_table as bridge_table
    from nemo_gym_grpc.bridge.ray.fleet import start_bridges as start_bridges
    from nemo_gym_grpc.bridge.ray.fleet import stop_bridges as stop_bridges

# Loaded on first use, so that `python -m nemo_gym_grpc.bridge.ray` without Ray gets to say so.
_NAMES = ("DEFAULT_PORT", "NAMESPACE", "REGISTRY_NAME", "bridge_table", "start_bridges")
_HOMES = dict.fromkeys((*_NAMES, "stop_bridges"), "nemo_gym_grpc.bridge.ray.fleet")

__all__ = sorted(_HOMES)
__getattr__, __dir__ = exports(__name__, _HOMES)
