"""What both halves (the bridge and the trainer side) share beside the contract: its service
names and limits (`contract`), the per-item failure reasons (`reasons`), the command-line
flags and value types (`flags`) and lazily loaded exports (`lazy`). It loads nothing beyond
grpc and the generated code (tests/test_shared_names.py)."""
