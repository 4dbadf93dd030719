"""TRL/axolotl reward functions that score with NVIDIA NeMo Gym through the nemo-gym-grpc bridge.

Drop-in for axolotl's `axolotl.integrations.nemo_gym.rewards` (same names and call shapes):

- `reward_nemo_gym_verify`: each completion scored by its resources server's `/verify`, the
  whole batch over one gRPC `VerifyStream`; a failed item gives None, never 0.0.
- `create_nemo_gym_reward_fn(global_config, verify_endpoints, ...)`: the same, bound to
  explicit endpoints.
- `reward_env`: passthrough of a precomputed `env_reward`.

Load by dotted path, e.g. in an axolotl config
`trl.reward_funcs: [nemo_gym_grpc.rewards.reward_nemo_gym_verify]`.
Configuration is by environment variable (see `settings.py`): `NEMO_GYM_GRPC_TARGET`,
`NEMO_GYM_HEAD_URL`, `NEMO_GYM_GRPC_BATCH_TIMEOUT`, `NEMO_GYM_GRPC_CONNECT_TIMEOUT`,
`NEMO_GYM_GRPC_STARTUP_TIMEOUT`. Modules: `functions` (the reward functions), `convert`
(arguments -> VerifyRequests), `client` (channels, the VerifyStream call), `embedded` (the
zero-config bridge subprocess).
"""

from nemo_gym_grpc.rewards.functions import (
    create_nemo_gym_reward_fn,
    reward_env,
    reward_nemo_gym_verify,
)

__all__ = ["create_nemo_gym_reward_fn", "reward_env", "reward_nemo_gym_verify"]
