"""The command line `nemo-gym-grpc` (`cli`) and its trainer-side commands: `score` (`score`,
`scorefile`), `export` (`export`); `openrlhf-rm` is `nemo_gym_grpc.rewards.openrlhf.serve`,
and `serve` is the bridge's own (`nemo_gym_grpc.bridge.cli`)."""
