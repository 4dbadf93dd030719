"""The taskset id `nemo-gym-grpc-verifiers` of verifiers' loader: it imports a taskset id as
one top-level module (`-` read as `_`) that exports exactly one `Taskset` subclass in
`__all__` (and at most one `Env`, the taskset's own), so a dotted name such as
`nemo_gym_grpc.rewards.verifiers` cannot be an id. This module is only that name (installed
from rewards/verifiers/taskset_id/)."""

from nemo_gym_grpc.rewards.verifiers.episodes import BridgeEnv
from nemo_gym_grpc.rewards.verifiers.taskset import BridgeTaskset

__all__ = ["BridgeEnv", "BridgeTaskset"]
