"""The trainer side's client machinery: everything between a trainer's call and the bridge.

- `settings`: every `NEMO_GYM_*` environment variable the trainer side reads.
- `channels`: gRPC channels to the bridge (credentials, options, the per-process cache).
- `ray_target`: the target `ray:` (the Ray cluster's bridges, this node's first).
- `per_process`: what a forked child must not share, and gRPC's fork support.
- `outcomes`: what one item came to (`Failure`, `Outcome`, `RunOutcome`), the client's reasons.
- `stream`: the one call path: where a call goes (`Route`: configured target or embedded
  bridge) and the one streaming call (`VerifyStream`, `RunStream`), outcomes by request_id.
- `stopping`: ending a sync call from another thread (`Stopper`).
- `live`: the long-lived feed of rollouts over successive `RunStream` calls (on `stream`).
- `embedded`: the zero-config bridge subprocess.
- `policy`: what failed items give (`on_error`, `max_failure_fraction`, `ScoringError`).
- `convert`: reward-function arguments -> `VerifyRequest`s, and the `Batch` of one call.
- `rollouts`: NeMo Gym rows -> `RunRequest`s, and `run_rollouts` / `arun_rollouts`.
- `stitch`: a multi-turn rollout's per-turn tokens -> one training sample (TRL, axolotl,
  SkyRL).
- `sessions`: NeMo Gym sessions (`SessionService`): `SessionClient`, `AsyncSessionClient`.

Importing this package sets gRPC's fork support first (`per_process`), before any of these
modules imports grpc.
"""

from nemo_gym_grpc.rewards.client import per_process as per_process
