"""The model's tool calls read from its text, and a SkyRL episode as the Responses object NeMo
Gym's `/verify` reads (rewards/skyrl/turns.py); no servers."""

from __future__ import annotations

import json

from nemo_gym_grpc.rewards.skyrl.turns import Episode, ToolCall, tool_calls


def test_calls_in_the_hermes_format_are_read_in_order_and_bad_ones_are_explained():
    text = (
        'Let me see. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": 2}"}\n</tool_call>'
        "<tool_call>{oops</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "c"}</tool_call>'
    )
    calls = tool_calls(text)
    assert [(c.name, c.arguments) for c in calls if isinstance(c, ToolCall)] == [
        ("a", {"x": 1}),
        ("b", {"y": 2}),
        ("c", {}),
    ]
    assert [c for c in calls if isinstance(c, str)] == [
        calls[2],
        'a tool call must be {"name": "...", "arguments": {...}}',
    ]
    assert str(calls[2]).startswith("the tool call is not JSON")
    assert len({c.call_id for c in calls if isinstance(c, ToolCall)}) == 3
    assert tool_calls("no calls here") == []


def test_an_episode_is_a_responses_object_with_calls_outputs_and_the_last_text():
    episode = Episode()
    (call,) = tool_calls(
        '<tool_call>{"name": "get_weather", "arguments": {"city": "sf"}}</tool_call>'
    )
    assert isinstance(call, ToolCall)
    episode.called(call, '{"city": "sf"}')
    episode.said("Cold.")
    tools = [{"type": "function", "name": "get_weather", "parameters": {}}]
    response = episode.response({"tools": tools})
    assert response["object"] == "response" and response["tools"] == tools
    kinds = [item["type"] for item in response["output"]]
    assert kinds == ["function_call", "function_call_output", "message"]
    function_call, output, message = response["output"]
    assert function_call["call_id"] == output["call_id"] == call.call_id
    assert json.loads(function_call["arguments"]) == {"city": "sf"}
    assert message["role"] == "assistant" and message["content"][0]["text"] == "Cold."
