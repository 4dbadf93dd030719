"""What both halves (the bridge and the trainer side) share beside the contract: its service
names, limits and defaults (`contract`), the per-item failure reasons (`reasons`), the
command-line flags and value types (`flags`), lazily loaded exports (`lazy`) and the lifecycle
of a bridge process (`child`). It loads nothing beyond grpc and the generated code
(tests/test_shared_names.py)."""
