"""SessionService against real NeMo Gym resources servers: a session opened, its tools called,
verified in, closed (by the caller, and by its lease), over real gRPC and real HTTP.

example_session_state_mgmt keeps a counter per session: `/seed_session` with `initial_count`
sets it, its tools `/increment_counter` and `/get_counter_value` change and read it, and
`/verify` rewards 1.0 when the row's `expected_count` equals the counter of the session its
cookie names. example_single_tool_call has the tool `/get_weather`; on 0.7 it takes typed
seeds and `/close_session`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2

from nemo_gym_grpc.rewards.client.sessions import AsyncSessionClient, SessionClient, SessionError
from nemo_gym_grpc.v1 import session_pb2, session_pb2_grpc, verify_pb2, verify_pb2_grpc
from tests.support import start_bridge
from tests.support.prometheus_scrape import metrics_url, scrape, value, wait_for
from tests.test_sessions import is_07

pytestmark = pytest.mark.compat  # also runs on NeMo Gym 0.4.0 (`make test`, second phase)

COUNTER = "example_session_state_mgmt"
WEATHER = "example_single_tool_call"
PARAMS = {"input": [{"role": "user", "content": "Count, then say the count."}]}


@pytest.fixture(scope="module")
def bridge(nemo_gym) -> Iterator:
    with start_bridge("--head-url", nemo_gym.head_url, "--metrics-port", "0") as started:
        yield started


@pytest.fixture(scope="module")
def stub(bridge) -> Iterator[session_pb2_grpc.SessionServiceStub]:
    with grpc.insecure_channel(bridge.target) as channel:
        yield session_pb2_grpc.SessionServiceStub(channel)


def reason(status) -> str:
    """The ErrorInfo reason of a `google.rpc.Status`."""
    (detail,) = status.details
    found = error_details_pb2.ErrorInfo()
    assert detail.Unpack(found)
    return found.reason


def open_counter(stub, initial: int, **fields) -> str:
    row = {"responses_create_params": PARAMS, "initial_count": initial}
    opened = stub.OpenSession(
        session_pb2.OpenSessionRequest(
            resources_server=COUNTER, row_json=json.dumps(row), **fields
        ),
        timeout=30,
    )
    assert opened.WhichOneof("outcome") == "session_id", opened.error
    return opened.session_id


def tool(stub, session_id: str, name: str, **arguments) -> session_pb2.CallToolResponse:
    request = session_pb2.CallToolRequest(
        session_id=session_id, tool=name, arguments_json=json.dumps(arguments)
    )
    return stub.CallTool(request, timeout=30)


def verify_count(stub, session_id: str, expected: int, close: bool = False):
    row = {"responses_create_params": PARAMS, "expected_count": expected}
    item = verify_pb2.VerifyRequest(
        request_id=f"count-{expected}", row_json=json.dumps(row), completion=str(expected)
    )
    request = session_pb2.VerifySessionRequest(session_id=session_id, item=item, close=close)
    return stub.VerifySession(request, timeout=30).result


def test_tool_calls_change_the_state_that_verify_in_the_same_session_reads(stub):
    first, second = open_counter(stub, 3), open_counter(stub, 10)
    for _ in range(2):
        assert json.loads(tool(stub, first, "increment_counter", count=2).output_json) == {
            "success": True
        }
    assert json.loads(tool(stub, first, "get_counter_value").output_json) == {"count": 7}
    assert json.loads(tool(stub, second, "get_counter_value").output_json) == {"count": 10}
    assert verify_count(stub, first, 7).reward == 1.0
    assert verify_count(stub, second, 7).reward == 0.0  # its own counter: 10
    closed = stub.CloseSession(session_pb2.CloseSessionRequest(session_id=first), timeout=10)
    assert closed.closed
    again = stub.CloseSession(session_pb2.CloseSessionRequest(session_id=first), timeout=10)
    assert not again.closed  # closing twice is harmless
    after = tool(stub, first, "get_counter_value")
    assert (after.error.code, reason(after.error)) == (code_pb2.NOT_FOUND, "SESSION_NOT_FOUND")
    assert verify_count(stub, second, 10, close=True).reward == 1.0
    assert not stub.CloseSession(session_pb2.CloseSessionRequest(session_id=second)).closed


def test_a_tool_the_server_lacks_and_bad_arguments_are_typed_failures(stub):
    session_id = open_counter(stub, 0)
    missing = tool(stub, session_id, "no_such_tool")
    assert (missing.error.code, reason(missing.error)) == (code_pb2.NOT_FOUND, "UNKNOWN_TOOL")
    bad = tool(stub, session_id, "increment_counter", count="many")  # the server's 422
    assert bad.error.code == code_pb2.INVALID_ARGUMENT
    not_object = stub.CallTool(
        session_pb2.CallToolRequest(
            session_id=session_id, tool="get_counter_value", arguments_json="[1]"
        )
    )
    assert (not_object.error.code, reason(not_object.error)) == (
        code_pb2.INVALID_ARGUMENT,
        "INVALID_ITEM",
    )
    route = tool(stub, session_id, "seed_session")
    assert reason(route.error) == "INVALID_ITEM"
    unknown = stub.OpenSession(session_pb2.OpenSessionRequest(resources_server="nope"))
    assert reason(unknown.error) == "UNKNOWN_RESOURCES_SERVER"
    assert stub.CloseSession(session_pb2.CloseSessionRequest(session_id=session_id)).closed


def test_the_weather_tool_in_a_session_and_a_verify_of_its_call(stub, nemo_gym):
    kind = session_pb2.SEED_KIND_TYPED if is_07(nemo_gym.version) else 0
    row = {"responses_create_params": PARAMS}
    opened = stub.OpenSession(
        session_pb2.OpenSessionRequest(
            resources_server=WEATHER, row_json=json.dumps(row), seed_kind=kind
        ),
        timeout=30,
    )
    assert opened.session_id, opened.error
    weather = tool(stub, opened.session_id, "get_weather", city="Oslo")
    assert "Oslo" in json.loads(weather.output_json)["weather_description"]
    call = {
        "type": "function_call",
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
        "call_id": "c1",
        "id": "fc1",
        "status": "completed",
    }
    response = {
        "id": "r1",
        "object": "response",
        "created_at": 0,
        "model": "scripted",
        "output": [call],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    item = verify_pb2.VerifyRequest(
        request_id="weather", row_json=json.dumps(row), response_json=json.dumps(response)
    )
    result = stub.VerifySession(
        session_pb2.VerifySessionRequest(session_id=opened.session_id, item=item, close=True),
        timeout=30,
    ).result
    assert result.reward == 1.0, result.error


def test_a_session_idle_past_its_lease_is_closed_upstream_once(nemo_gym):
    # a bridge of its own: the module's closes other tests' sessions in the background
    # (CloseSession and verify(close=True) return first), which its counter would count here
    with start_bridge("--head-url", nemo_gym.head_url, "--metrics-port", "0") as bridge:
        with grpc.insecure_channel(bridge.target) as channel:
            stub = session_pb2_grpc.SessionServiceStub(channel)
            lease_closes_once(stub, metrics_url(bridge), is_07(nemo_gym.version))


def lease_closes_once(stub: session_pb2_grpc.SessionServiceStub, url: str, on_07: bool) -> None:
    """A session opened with a 0.5 s lease and left idle is closed upstream, once."""
    row = json.dumps({"responses_create_params": PARAMS})
    opened = stub.OpenSession(
        session_pb2.OpenSessionRequest(resources_server=WEATHER, row_json=row, lease_seconds=0.5),
        timeout=30,
    )
    assert opened.lease_seconds == 0.5
    assert tool(stub, opened.session_id, "get_weather", city="Rome").output_json
    idle = wait_for(url, lambda s: value(s, "nemo_gym_grpc_open_sessions") == 0)
    assert value(idle, "nemo_gym_grpc_open_sessions") == 0  # no call touched it meanwhile
    after = tool(stub, opened.session_id, "get_weather", city="Rome")
    assert reason(after.error) == "SESSION_NOT_FOUND"
    if on_07:  # 0.4 has no /close_session: the bridge forgets the cookie
        samples = scrape(url)
        assert value(samples, "nemo_gym_grpc_session_closes_total", resources_server=WEATHER) == 1


def counter_row(**fields) -> dict:
    return {"responses_create_params": PARAMS, **fields}


def test_the_python_session_client_drives_a_session_and_closes_it(bridge):
    with SessionClient(bridge.target) as client:
        with client.open(COUNTER, counter_row(initial_count=1)) as session:
            assert session.call_tool("increment_counter", {"count": 4}) == {"success": True}
            result = session.verify(completion="5", row=counter_row(expected_count=5))
            assert result.reward == 1.0
        assert not session.close()  # the block closed it
        with pytest.raises(SessionError) as gone:
            session.call_tool("get_counter_value")
        assert gone.value.failure.reason == "SESSION_NOT_FOUND"
        with pytest.raises(SessionError) as unknown:
            client.open("no_such_server")
        assert unknown.value.failure.reason == "UNKNOWN_RESOURCES_SERVER"


async def test_the_async_session_client_runs_sessions_side_by_side(bridge):
    async with AsyncSessionClient(bridge.target) as client:
        sessions = [await client.open(COUNTER, counter_row(initial_count=n)) for n in range(8)]
        await asyncio.gather(*(s.call_tool("increment_counter", {"count": 10}) for s in sessions))
        counts = await asyncio.gather(*(s.call_tool("get_counter_value") for s in sessions))
        assert [c["count"] for c in counts] == [n + 10 for n in range(8)]
        rows = [counter_row(expected_count=n + 10) for n in range(8)]
        results = await asyncio.gather(
            *(
                s.verify(completion="x", row=r, close=True)
                for s, r in zip(sessions, rows, strict=True)
            )
        )
        assert [r.reward for r in results] == [1.0] * 8
        assert not any(await asyncio.gather(*(s.close() for s in sessions)))


def test_the_listing_says_each_servers_tools_and_session_support(bridge, nemo_gym):
    """The first listing, while the 0.7 servers still build their first `/openapi.json`,
    waits for them (tests/test_listing_wait.py)."""
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        listed = stub.ListResourcesServers(verify_pb2.ListResourcesServersRequest(), timeout=30)
        by_name = {s.name: s for s in listed.resources_servers}
    assert all(s.capabilities_known for s in by_name.values()), by_name
    assert list(by_name[COUNTER].tools) == ["get_counter_value", "increment_counter"]
    assert list(by_name[WEATHER].tools) == ["get_weather"]
    assert list(by_name["mcqa"].tools) == []
    new = is_07(nemo_gym.version)
    assert (by_name[WEATHER].typed_sessions, by_name[WEATHER].close_session) == (new, new)
    assert by_name["mcqa"].reverify_mode == ("stateless" if new else "")
