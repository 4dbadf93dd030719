"""TRL/axolotl reward functions that score with NVIDIA NeMo Gym through the nemo-gym-grpc bridge.

Drop-in for axolotl's `axolotl.integrations.nemo_gym.rewards` (same names and call shapes):

- `reward_nemo_gym_verify`: each completion scored by its resources server's `/verify`, the
  whole batch over one gRPC `VerifyStream`; a failed item gives None (by default), never a
  silent 0.0. `reward_nemo_gym_verify_async`: the same as a coroutine function (grpc.aio),
  for TRL's async reward path.
- `create_nemo_gym_reward_fn(global_config, verify_endpoints, ...)`: the same, bound to
  explicit endpoints, with the failure policy (`on_error`, `max_failure_fraction`) and
  `asynchronous` as keywords.
- `reward_env`: passthrough of a precomputed `env_reward`.
- `ScoringError`: raised when a call fails under its failure policy.

Load by dotted path, e.g. in an axolotl config
`trl.reward_funcs: [nemo_gym_grpc.rewards.reward_nemo_gym_verify]`.
Configuration is by environment variable: the list is in `settings.py`.
Modules: `functions` (the reward functions), `convert` (arguments -> VerifyRequests),
`outcomes` (`Failure`, `Outcome`), `client` (the VerifyStream call), `channels` (gRPC
channels), `policy` (what failed items give), `trl_logging` (TRL's `log_metric` /
`log_extra`), `embedded` (the zero-config bridge subprocess), `score` and `scorefile` (the
`nemo-gym-grpc score` command).
"""

import os

# Trainers fork (DataLoader workers, multiprocessing) after the reward functions have used
# gRPC. Without gRPC's fork support a forked child that scores crashes now and then inside
# gRPC core ("Check failed: next_worker->state == KICKED"). It must be set before gRPC
# starts, so it is set here, unless the user set it.
# (The embedded bridge, a grpc.aio server that forks only before gRPC starts, does not get it.)
FORK_SUPPORT_DEFAULTED = "GRPC_ENABLE_FORK_SUPPORT" not in os.environ
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "1")

from nemo_gym_grpc.rewards.functions import (  # noqa: E402 (after the gRPC setting above)
    create_nemo_gym_reward_fn,
    reward_env,
    reward_nemo_gym_verify,
    reward_nemo_gym_verify_async,
)
from nemo_gym_grpc.rewards.policy import ScoringError  # noqa: E402

__all__ = [
    "ScoringError",
    "create_nemo_gym_reward_fn",
    "reward_env",
    "reward_nemo_gym_verify",
    "reward_nemo_gym_verify_async",
]
