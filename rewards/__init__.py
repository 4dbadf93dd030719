"""TRL/axolotl reward functions that score with NVIDIA NeMo Gym through the nemo-gym-grpc bridge.

Drop-in for axolotl's `axolotl.integrations.nemo_gym.rewards` (same names and call shapes):

- `reward_nemo_gym_verify`: each completion scored by its resources server's `/verify`, the
  whole batch over one gRPC `VerifyStream`; a failed item gives None (by default), never a
  silent 0.0. `reward_nemo_gym_verify_async`: the same as a coroutine function (grpc.aio),
  for TRL's async reward path.
- `create_nemo_gym_reward_fn(global_config, verify_endpoints, ...)`: the same, bound to
  explicit endpoints, with the failure policy (`on_error`, `max_failure_fraction`) and
  `asynchronous` as keywords.
- `reward_env`: passthrough of a precomputed `env_reward` (the rollouts' rewards).
- `create_nemo_gym_rollout_func(agent, ...)`: a TRL `rollout_func` running each prompt as a
  NeMo Gym rollout (agent `/run`) over one gRPC `RunStream` per call, tokens stitched across
  turns, failed rollouts masked with reward NaN (`trl_rollouts`).
- `create_nemo_gym_rollout_worker(rows, args, agent, ...)`: a `rollout_worker` for TRL 1.16's
  `AsyncGRPOTrainer`: rollouts kept in flight on one long-lived `RunStream`, trained on as
  their groups finish (`trl_async`).
- `run_rollouts(rows, agent=..., target=...)` / `arun_rollouts`: NeMo Gym dataset rows ->
  rollouts, one outcome per row (`rollouts`).
- `ScoringError`: raised when a call fails under its failure policy.

Load by dotted path, e.g. in an axolotl config
`trl.reward_funcs: [nemo_gym_grpc.rewards.reward_nemo_gym_verify]`.
Configuration is by environment variable: the list is in `settings.py`.
Modules: `functions` (the reward functions), `convert` (arguments -> VerifyRequests),
`rollouts` (rows -> RunRequests, the rollout calls), `stitch` (per-turn tokens -> one sample),
`trl_rollouts` (the TRL rollout_func), `trl_async`, `rollout_engine`, `rollout_groups` and
`live_stream` (the AsyncGRPOTrainer rollout worker, its engine, its groups and its
long-lived RunStream), `outcomes` (`Failure`, `Outcome`, `RunOutcome`),
`client` (the VerifyStream and RunStream calls), `channels` (gRPC channels), `policy` (what
failed items give), `trl_logging` (TRL's `log_metric` / `log_extra`), `embedded` (the
zero-config bridge subprocess), `score` and `scorefile` (the `nemo-gym-grpc score` command).
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
from nemo_gym_grpc.rewards.rollouts import arun_rollouts, run_rollouts  # noqa: E402
from nemo_gym_grpc.rewards.trl_async import create_nemo_gym_rollout_worker  # noqa: E402
from nemo_gym_grpc.rewards.trl_rollouts import create_nemo_gym_rollout_func  # noqa: E402

__all__ = [
    "ScoringError",
    "arun_rollouts",
    "create_nemo_gym_rollout_func",
    "create_nemo_gym_rollout_worker",
    "create_nemo_gym_reward_fn",
    "reward_env",
    "reward_nemo_gym_verify",
    "reward_nemo_gym_verify_async",
    "run_rollouts",
]
