"""`reward_components` from NeMo Gym's real example_tool_call_multireward server, through the
bridge: the server scores one expected tool call on correctness, schema_valid and format, and
its reward is their sum."""

from __future__ import annotations

import json

import grpc
import pytest

from nemo_gym_grpc.bridge.nemo_gym.verify import completion_response
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import example_rows

pytestmark = pytest.mark.compat  # also runs on NeMo Gym 0.4.0 (`make test`, second phase)

SERVER = "example_tool_call_multireward"


def tool_call_response(arguments: str, text: str | None = None) -> dict:
    """A Responses object holding one get_weather function call (and a message with `text`)."""
    response = completion_response(text or "", "policy")
    call = {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": arguments,
        "status": "completed",
    }
    response["output"] = [call] + (response["output"] if text else [])
    return response


@pytest.mark.parametrize(
    ("arguments", "text", "components"),
    [
        ('{"city": "San Francisco"}', None, (1.0, 1.0, 1.0)),
        ('{"city": "Paris"}', None, (0.0, 1.0, 1.0)),
        ('{"town": "San Francisco"}', None, (0.0, 0.0, 1.0)),
        ('{"city": "San Francisco"}', "Here you go.", (1.0, 1.0, 0.0)),
    ],
)
def test_reward_components_come_back_with_the_reward(bridge_target, arguments, text, components):
    row = example_rows(SERVER)[0]
    assert row["expected_call"]["arguments"] == {"city": "San Francisco"}
    request = verify_pb2.VerifyRequest(
        request_id="multi",
        resources_server=SERVER,
        row_json=json.dumps(row),
        response_json=json.dumps(tool_call_response(arguments, text)),
        include_reply=True,
    )
    with grpc.insecure_channel(bridge_target) as channel:
        result = verify_pb2_grpc.VerifyServiceStub(channel).Verify(request, timeout=30)
    assert not result.HasField("error"), result.error.message
    expected = dict(zip(("correctness", "schema_valid", "format"), components, strict=True))
    assert dict(result.reward_components) == expected
    assert result.reward == sum(components)
    reply = json.loads(result.reply_json)
    assert "reward_components" not in reply and reply["correctness"] == components[0]
