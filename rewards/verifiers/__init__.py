"""verifiers 0.4 (PrimeIntellect; what prime-rl trains on): NeMo Gym tasks through the bridge's
sessions. Taskset id `nemo-gym-grpc-verifiers` (docs/verifiers.md); the classes: taskset.py,
and its env (step-wise servers' episodes): episodes.py."""

from nemo_gym_grpc.rewards.verifiers.episodes import BridgeEnv
from nemo_gym_grpc.rewards.verifiers.taskset import (
    BridgeConfig,
    BridgeState,
    BridgeTask,
    BridgeTaskConfig,
    BridgeTaskset,
)

__all__ = [
    "BridgeConfig",
    "BridgeEnv",
    "BridgeState",
    "BridgeTask",
    "BridgeTaskConfig",
    "BridgeTaskset",
]
