"""SkyRL (NovaSky; skyrl-gym 0.4) on the bridge (docs/skyrl.md).

- `env`: `NemoGymEnv`, a skyrl-gym environment whose episode is a NeMo Gym session: seeded at
  `init`, the model's tool calls run in it at each `step`, verified in it at the last;
  `NemoGymEnvError` for a step that failed for reasons not the model's.
- `turns`: the model's tool calls read from its text, and the episode as a Responses object.
- `generator`: `NemoGymGenerator`, a SkyRL generator whose trajectories are whole NeMo Gym
  agent rollouts (`RunStream`); needs skyrl itself. `trajectories`: rollouts -> its output
  fields, a failed rollout's group masked.

`register()` makes the env known to skyrl_gym; call it where SkyRL makes its envs (its
entrypoint) and choose it with `environment.env_class=nemo_gym`.
"""

from __future__ import annotations

ENTRY_POINT = "nemo_gym_grpc.rewards.skyrl.env:NemoGymEnv"


def register(env_id: str = "nemo_gym") -> None:
    """Register `NemoGymEnv` with skyrl_gym under `env_id` (SkyRL's `environment.env_class`);
    nothing happens when it is registered already.

    Raises:
        ImportError: skyrl-gym is not installed (`pip install 'nemo-gym-grpc[skyrl]'`).
        ValueError: `env_id` is registered to another environment.
    """
    from skyrl_gym.envs import registration

    known = registration.registry.get(env_id)
    if known is not None:
        if known.entry_point != ENTRY_POINT:
            raise ValueError(f"skyrl_gym env {env_id!r} is {known.entry_point}, not ours")
        return
    registration.register(id=env_id, entry_point=ENTRY_POINT)
