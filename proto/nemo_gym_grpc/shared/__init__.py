"""What both halves (the bridge and the trainer side) share beside the contract: its service
names, limits and defaults (`contract`), the per-item failure reasons (`reasons`), the
command-line flags and value types (`flags`), what an upstream's host and port may be
(`addresses`), lazily loaded exports (`lazy`), the lifecycle of a bridge process (`child`) and
the rule for a rollout that runs far longer than its peers (`stragglers`). It loads nothing
beyond grpc and the generated code (tests/test_shared_names.py)."""
