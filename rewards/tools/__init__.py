"""The trainer-side commands of `nemo-gym-grpc` (`nemo_gym_grpc.cli`): `score` (`score`,
`scorefile`, `batches`, `verdicts`) and `export` (`export`); `openrlhf-rm` is
`nemo_gym_grpc.rewards.openrlhf.serve`, and `serve` is the bridge's own
(`nemo_gym_grpc.bridge.process.cli`)."""
