"""A SkyRL episode's turns as NeMo Gym reads them: the tool calls in a model's text, and the
episode as the OpenAI Responses object `/verify` scores.

SkyRL's envs get the model's text (`BaseTextEnv.step(action: str)`), tool calls included, in
whatever format the chat template taught the model. Ours reads the Hermes format that Qwen's
and most open chat templates use: each call a JSON object `{"name": ..., "arguments": {...}}`
between `<tool_call>` and `</tool_call>`. The Responses object holds, per turn, a
`function_call` item per call and its `function_call_output`, and the last turn's text as an
assistant `message`, as NeMo Gym's own agents write it (`responses_api_agents/simple_agent`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_grpc.rewards.client import steps

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `name`, `arguments` (a JSON object), and `call_id`."""

    name: str
    arguments: dict[str, Any]
    call_id: str


def tool_calls(text: str) -> list[ToolCall | str]:
    """The calls in `text`, in order; a call that is not a JSON object with a string "name"
    (and an object "arguments", default `{}`) is the text of what is wrong with it (the model
    is told, as a tool output)."""
    calls: list[ToolCall | str] = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except ValueError as exc:
            calls.append(f"the tool call is not JSON ({exc})")
            continue
        name = call.get("name") if isinstance(call, dict) else None
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some templates write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            calls.append('a tool call must be {"name": "...", "arguments": {...}}')
            continue
        calls.append(ToolCall(name, arguments, f"call_{uuid.uuid4().hex[:16]}"))
    return calls


@dataclass
class Episode:
    """The Responses output items of an episode so far (`output`)."""

    output: list[dict[str, Any]] = field(default_factory=list)

    def calling(self, call: ToolCall) -> None:
        """Record `call` (a step-wise server runs it in its `/step` and returns its output)."""
        self.output.append(steps.function_call(call.name, call.arguments, call.call_id))

    def called(self, call: ToolCall, result: str) -> None:
        """Record `call` and the text it returned."""
        self.calling(call)
        self.output.append(
            {"type": "function_call_output", "call_id": call.call_id, "output": result}
        )

    def said(self, text: str) -> None:
        """Record the model's closing text (its tool calls left out)."""
        self.output.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex[:16]}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        )

    def response(self, params: dict[str, Any]) -> dict[str, Any]:
        """The Responses object of the episode, for the row's `responses_create_params`."""
        return steps.response(self.output, params, model="skyrl")
