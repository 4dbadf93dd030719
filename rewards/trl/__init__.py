"""The TRL (and axolotl) adapter: reward functions, the rollout function and the rollout worker.

- `functions`: `reward_nemo_gym_verify` (and `_async`), `create_nemo_gym_reward_fn`,
  `reward_env`.
- `logs`: the per-item extras for TRL's `log_metric` / `log_extra`.
- `rollout_func`: `create_nemo_gym_rollout_func`, TRL's `GRPOTrainer(rollout_func=...)`.
- `rollout_worker`: `create_nemo_gym_rollout_worker`, a `rollout_worker` for TRL 1.16's
  `AsyncGRPOTrainer`; `worker_engine` (its rollouts in flight) and `groups` (a finished
  group's samples and advantages).
- `rows`: from TRL's prompts back to the dataset rows.
- `unscorable`: `nemo_gym_reward_funcs`, NeMo Gym's function beside others, a failed NeMo Gym
  item None in every column.

The public names are exported by `nemo_gym_grpc.rewards`.
"""
