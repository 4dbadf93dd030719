"""Helpers for the rollout tests (tests/test_run_*.py): a RolloutService stub on a bridge
process, and the expected token ids of a weather rollout on the agent stack.

    with rollout_stub(bridge) as stub:
        stub.Run(run_request("w1", WEATHER_AGENT, weather_row), timeout=RUN_DEADLINE)
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import grpc

from nemo_gym_grpc.v1 import rollout_pb2, rollout_pb2_grpc
from tests.support import toy_chat
from tests.support.bridge import BridgeProcess
from tests.support.policy_model import FORECAST_PREFIX, WEATHER_ARGUMENTS, WEATHER_TOOL

RUN_DEADLINE = 120.0  # s, the gRPC deadline of a rollout call in these tests (a bound only)


@contextlib.contextmanager
def rollout_stub(bridge: BridgeProcess) -> Iterator[rollout_pb2_grpc.RolloutServiceStub]:
    """A RolloutService stub on a plaintext channel to `bridge`, closed on exit."""
    with grpc.insecure_channel(bridge.target) as channel:
        yield rollout_pb2_grpc.RolloutServiceStub(channel)


def run_request(
    request_id: str, agent: str, row: dict[str, Any] | None = None, **fields: Any
) -> rollout_pb2.RunRequest:
    """A RunRequest for `row` (sent as `row_json`) on `agent`."""
    if row is not None:
        fields["row_json"] = json.dumps(row)
    return rollout_pb2.RunRequest(request_id=request_id, agent=agent, **fields)


def by_id(messages: Iterator[rollout_pb2.RunStreamResponse]) -> dict[str, rollout_pb2.RunResponse]:
    """The results of a RunStream call by request_id; asserts each id comes once."""
    found: dict[str, rollout_pb2.RunResponse] = {}
    for message in messages:
        for result in message.results:
            assert result.request_id not in found, f"{result.request_id} answered twice"
            found[result.request_id] = result
    return found


def weather_turns(
    row: dict[str, Any], tool_output: str
) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, generated ids, log probs) of the two model calls of a weather rollout of
    `row` (a get_weather call, then the forecast), as the scripted policy's toy tokenizer
    gives them (tests/support/toy_chat.py); `tool_output` is the tool's reply text."""
    params = row["responses_create_params"]
    messages = [{"role": m["role"], "content": m["content"]} for m in params["input"]]
    tools = params["tools"]
    call = {"function": {"name": WEATHER_TOOL, "arguments": WEATHER_ARGUMENTS}}
    first = {"role": "assistant", "content": None, "tool_calls": [call]}
    answer = {"role": "assistant", "content": f"{FORECAST_PREFIX} The weather in sf is cold."}
    history = [*messages, first, {"role": "tool", "content": tool_output}]
    turns = []
    for prompt_messages, message in ((messages, first), (history, answer)):
        generated = toy_chat.generation_token_ids(message)
        turns.append(
            (
                toy_chat.prompt_token_ids(prompt_messages, tools),
                generated,
                toy_chat.log_probs(generated),
            )
        )
    return turns
