"""Resources servers that offer their tools over MCP, through the bridge's sessions (real NeMo
Gym 0.7 servers):

- example_mcp_weather (`expose_tools_over_mcp: true`; its rows carry `"tools": []` because its
  agent lists the tools at `/mcp`): ListResourcesServers gives each tool as a Responses function
  tool (its body's JSON schema, its docstring), so a trainer that drives the model can offer it;
  a session calls the tool by its route, which runs the same handler MCP's `tools/call` runs
  (nemo_gym/mcp_auto_exposure.py), and is scored in that session;
- workplace_assistant (27 tools behind one catch-all route, `POST /{path}`, listed over MCP from
  its data, and carried by its rows): the catch-all is not listed as a tool, and a session
  calls each tool by name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest

from nemo_gym_grpc.rewards.client.sessions import SessionClient
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import NemoGymServers, resources_server_dir, start_bridge

pytestmark = pytest.mark.nemo_gym_07  # example_mcp_weather is new in 0.7

SERVER = "example_mcp_weather"
CATCH_ALL = "workplace_assistant"


@pytest.fixture(scope="module")
def bridge(nemo_gym_venv) -> Iterator:
    with NemoGymServers((SERVER, CATCH_ALL), venv=nemo_gym_venv) as gym:
        with start_bridge("--head-url", gym.head_url) as started:
            yield started


def first_row(server: str = SERVER) -> dict:
    """The first row of `server`'s data/example.jsonl (example_mcp_weather's asks for Paris)."""
    path = resources_server_dir(server) / "data" / "example.jsonl"
    return json.loads(path.read_text().splitlines()[0])


def listing(bridge) -> dict[str, verify_pb2.ResourcesServer]:
    """The bridge's ListResourcesServers, by name."""
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        request = verify_pb2.ListResourcesServersRequest()
        listed = stub.ListResourcesServers(request, timeout=30).resources_servers
    return {server.name: server for server in listed}


def test_the_listing_gives_the_tools_its_rows_leave_out(bridge):
    assert first_row()["responses_create_params"]["tools"] == []
    server = listing(bridge)[SERVER]
    assert list(server.tools) == ["get_weather"]
    tool = json.loads(server.function_tools_json[0])
    assert (tool["type"], tool["name"]) == ("function", "get_weather")
    assert tool["description"] == "Get a deterministic weather report for a city."
    assert tool["parameters"]["properties"]["city"]["type"] == "string"
    assert tool["parameters"]["required"] == ["city"]


def test_a_session_calls_the_tool_by_its_route_and_is_scored_in_it(bridge):
    row = first_row()
    with SessionClient(bridge.target) as client:
        with client.open(SERVER, row) as session:
            weather = session.call_tool("get_weather", {"city": "Paris"})["weather"]
            called = session.verify(completion=weather, row=row)
        with client.open(SERVER, row) as session:  # the same answer without the tool call
            not_called = session.verify(completion=weather, row=row)
    assert weather == "The weather in Paris is sunny and 72 F."
    assert (called.reward, not_called.reward) == (1.0, 0.0)


def test_tools_behind_a_catch_all_route_are_called_by_name(bridge):
    server = listing(bridge)[CATCH_ALL]
    assert server.capabilities_known and list(server.tools) == []
    row = first_row(CATCH_ALL)
    offered = [tool["name"] for tool in row["responses_create_params"]["tools"]]
    assert len(offered) == 27 and "company_directory_find_email_address" in offered
    with SessionClient(bridge.target) as client, client.open(CATCH_ALL, row) as session:
        found = session.call_tool("company_directory_find_email_address", {"name": "chenwei"})
    assert found == {"output": ["chenwei.zhang@atlas.com"]}
