"""The nemo-gym-grpc bridge: gRPC `nemo_gym_grpc.v1.VerifyService` in front of NeMo Gym
resources servers' HTTP `POST /verify`.

Run it with `nemo-gym-grpc serve` (see `cli.py`) or embed it with `serve(BridgeConfig(...))`.
"""

from nemo_gym_grpc.bridge.config import BridgeConfig
from nemo_gym_grpc.bridge.server import serve

__all__ = ["BridgeConfig", "serve"]
