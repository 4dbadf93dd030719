"""A bridge on every node of a Ray cluster (the `[ray]` extra: `pip install 'nemo-gym-grpc[ray]'`).

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

from nemo_gym_grpc.bridge.ray.fleet import (
    DEFAULT_PORT,
    NAMESPACE,
    REGISTRY_NAME,
    bridge_table,
    start_bridges,
    stop_bridges,
)

__all__ = [
    "DEFAULT_PORT",
    "NAMESPACE",
    "REGISTRY_NAME",
    "bridge_table",
    "start_bridges",
    "stop_bridges",
]
