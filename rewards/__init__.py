"""The trainer side of nemo-gym-grpc: TRL/axolotl reward functions, rollouts and the adapters of
other trainers, scoring with NVIDIA NeMo Gym through the gRPC bridge.

Drop-in for axolotl's `axolotl.integrations.nemo_gym.rewards` (same names and call shapes):

- `reward_nemo_gym_verify`: each completion scored by its resources server's `/verify`, the
  whole batch over one gRPC `VerifyStream`; a failed item gives None (by default), never a
  silent 0.0. `reward_nemo_gym_verify_async`: the same as a coroutine function (grpc.aio),
  for TRL's async reward path.
- `create_nemo_gym_reward_fn(global_config, verify_endpoints, ...)`: the same, bound to
  explicit endpoints, with the failure policy (`on_error`, `max_failure_fraction`) and
  `asynchronous` as keywords.
- `reward_env`: passthrough of a precomputed `env_reward` (the rollouts' rewards).
- `nemo_gym_reward_funcs(nemo_gym, *others)`: TRL's `reward_funcs` with NeMo Gym's function
  beside others (a format reward, ...), wrapped so that a completion NeMo Gym could not score
  is None in every column (unscorable in TRL), not scored by the others alone.
- `create_nemo_gym_rollout_func(agent, ...)`: a TRL `rollout_func` running each prompt as a
  NeMo Gym rollout (agent `/run`) over one gRPC `RunStream` per call.
- `create_nemo_gym_rollout_worker(rows, args, agent, ...)`: a `rollout_worker` for TRL 1.16's
  `AsyncGRPOTrainer`: rollouts kept in flight on one long-lived `RunStream`, trained on as
  their groups finish.
- `run_rollouts(rows, agent=..., target=...)` / `arun_rollouts`: NeMo Gym dataset rows ->
  rollouts, one outcome per row.
- `ScoringError`: raised when a call fails under its failure policy.

Load by dotted path, e.g. in an axolotl config
`trl.reward_funcs: [nemo_gym_grpc.rewards.reward_nemo_gym_verify]`.
Configuration is by environment variable: the list is in `client/settings.py`.

Subpackages: `client` (the machinery every adapter shares: settings, channels, the one stream
call, outcomes, the embedded bridge, the failure policy), `trl` (the TRL adapter), `axolotl`
(the axolotl plugin, on `trl`), `tools` (the `nemo-gym-grpc` command line: `score`,
`export`), `verifiers` (the verifiers 0.4 taskset) and `skyrl` (the SkyRL environment), both
on the bridge's sessions; modules `verl`, `verl_manager`, `slime` and `openrlhf` (those
trainers' adapters, on `stacks`).

The names above load on first use (PEP 562), so importing this package (as the command line
does for `serve`) loads no gRPC client and changes nothing; `nemo_gym_grpc.rewards.client` sets
gRPC's fork support when the client loads (`client/per_process.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nemo_gym_grpc.shared.lazy import exports

if TYPE_CHECKING:  # the same names, for type checkers (the `as` marks a re-export)
    from nemo_gym_grpc.rewards.client.policy import ScoringError as ScoringError
    from nemo_gym_grpc.rewards.client.rollouts import arun_rollouts as arun_rollouts
    from nemo_gym_grpc.rewards.client.rollouts import run_rollouts as run_rollouts
    from nemo_gym_grpc.rewards.trl.functions import (
        create_nemo_gym_reward_fn as create_nemo_gym_reward_fn,
    )
    from nemo_gym_grpc.rewards.trl.functions import reward_env as reward_env
    from nemo_gym_grpc.rewards.trl.functions import (
        reward_nemo_gym_verify as reward_nemo_gym_verify,
    )
    from nemo_gym_grpc.rewards.trl.functions import (
        reward_nemo_gym_verify_async as reward_nemo_gym_verify_async,
    )
    from nemo_gym_grpc.rewards.trl.rollout_func import (
        create_nemo_gym_rollout_func as create_nemo_gym_rollout_func,
    )
    from nemo_gym_grpc.rewards.trl.rollout_worker import (
        create_nemo_gym_rollout_worker as create_nemo_gym_rollout_worker,
    )
    from nemo_gym_grpc.rewards.trl.unscorable import (
        nemo_gym_reward_funcs as nemo_gym_reward_funcs,
    )

# Each public name -> the module that defines it.
_HOMES = {
    "ScoringError": "nemo_gym_grpc.rewards.client.policy",
    "arun_rollouts": "nemo_gym_grpc.rewards.client.rollouts",
    "run_rollouts": "nemo_gym_grpc.rewards.client.rollouts",
    "create_nemo_gym_reward_fn": "nemo_gym_grpc.rewards.trl.functions",
    "reward_env": "nemo_gym_grpc.rewards.trl.functions",
    "reward_nemo_gym_verify": "nemo_gym_grpc.rewards.trl.functions",
    "reward_nemo_gym_verify_async": "nemo_gym_grpc.rewards.trl.functions",
    "create_nemo_gym_rollout_func": "nemo_gym_grpc.rewards.trl.rollout_func",
    "create_nemo_gym_rollout_worker": "nemo_gym_grpc.rewards.trl.rollout_worker",
    "nemo_gym_reward_funcs": "nemo_gym_grpc.rewards.trl.unscorable",
}

__all__ = sorted(_HOMES)
__getattr__, __dir__ = exports(__name__, _HOMES)
