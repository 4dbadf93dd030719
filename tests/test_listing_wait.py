"""ListResourcesServers waits for what a server supports until its learning ends or the call's
deadline is near, not an item's 2 s: a trainer reads the listed tools once, at its start, when
every NeMo Gym 0.7 server is cold and builds its first `/openapi.json` for seconds.

The upstream is a scripted server (tests/support/canned_http.py) that answers
`/openapi.json` after a set time, because a real server's cold start is not that slow on
demand (it is on a loaded machine: a CI run's example_mcp_weather listing came back empty).
"""

from __future__ import annotations

import json

import grpc

from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import start_bridge
from tests.support.canned_http import CannedServer, canned

# Seconds the scripted server takes to answer `/openapi.json`: past an item's 2 s.
COLD_OPENAPI = 2.5
WEATHER = {
    "paths": {
        "/verify": {"post": {}},
        "/get_weather": {"post": {"summary": "Get Weather", "description": "The weather."}},
    }
}


def listed(stub: verify_pb2_grpc.VerifyServiceStub, timeout: float) -> verify_pb2.ResourcesServer:
    """The bridge's one listed server, asked with a `timeout` s deadline."""
    request = verify_pb2.ListResourcesServersRequest()
    (server,) = stub.ListResourcesServers(request, timeout=timeout).resources_servers
    return server


def test_a_listing_waits_for_a_cold_server_and_answers_before_its_deadline():
    with CannedServer(work=COLD_OPENAPI) as upstream:
        upstream.answer("GET /openapi.json", canned(200, json.dumps(WEATHER).encode()))
        with start_bridge("--server", f"weather={upstream.url}") as bridge:
            with grpc.insecure_channel(bridge.target) as channel:
                stub = verify_pb2_grpc.VerifyServiceStub(channel)
                early = listed(stub, timeout=1.0)  # answered 0.5 s before its deadline
                cold = listed(stub, timeout=30.0)  # waits out the rest of the learning
    assert not early.capabilities_known and list(early.tools) == []
    assert cold.capabilities_known and list(cold.tools) == ["get_weather"]
    assert upstream.seen.count("GET /openapi.json") == 1
