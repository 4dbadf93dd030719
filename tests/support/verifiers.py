"""An in-process `Verifier` for tests that drive the bridge's item path without a gRPC server
(real HTTP to whatever `upstreams` name)."""

from __future__ import annotations

from typing import Any

import aiohttp

from nemo_gym_grpc.bridge.flows.upstreams import Upstreams
from nemo_gym_grpc.bridge.flows.verify import Verifier
from nemo_gym_grpc.bridge.nemo_gym import http
from nemo_gym_grpc.bridge.process.config import BridgeConfig
from nemo_gym_grpc.bridge.process.metrics import Metrics


def verifier_for(
    upstreams: Upstreams, session: aiohttp.ClientSession, *, builtin: bool = True, **settings: Any
) -> Verifier:
    """A Verifier with the bridge's default settings, except `settings` (Verifier's keywords);
    its POSTs to http:// URLs over the bridge's own client unless `builtin` is False."""
    config = BridgeConfig()
    defaults = dict(
        default_timeout=config.verify_timeout,
        max_in_flight=config.max_in_flight,
        retry=config.retry,
        max_item_bytes=config.max_item_bytes,
        session_servers=config.session_servers,
        metrics=Metrics(),
    )
    return Verifier(upstreams, http.Client(session, builtin=builtin), **(defaults | settings))
