"""A step-wise NeMo Gym server's steps as the trainer adapters write and read them (SkyRL's
`NemoGymEnv`, the verifiers toolset): the Responses object a `/step` acts with, its
`function_call` items (calls the server runs in that step, NeMo Gym 0.7's gymnasium servers),
and what a step answered (`StepResult`: its `info`, the outputs of the calls it ran, listed in
`info["tool_outputs"]` as those servers list them, and its observation).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any


def function_call(name: str, arguments: Mapping[str, Any], call_id: str) -> dict[str, Any]:
    """The Responses `function_call` output item of a call of tool `name` with `arguments` (a
    JSON object)."""
    return {
        "type": "function_call",
        "id": f"fc_{call_id}",
        "call_id": call_id,
        "name": name,
        "arguments": json.dumps(dict(arguments)),
        "status": "completed",
    }


def response(output: list[dict[str, Any]], params: Mapping[str, Any], model: str) -> dict[str, Any]:
    """The Responses object with `output` items, for a row's `responses_create_params`
    (`params`: its model, else `model`, and its tools)."""
    return {
        "id": f"resp_{uuid.uuid4().hex[:16]}",
        "object": "response",
        "created_at": 0,
        "model": str(params.get("model") or model),
        "output": list(output),
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": list(params.get("tools") or []),
    }


def info(result: Any) -> dict[str, Any]:
    """A StepResult's `info` (its `info_json`, parsed); {} without one or when it is not a JSON
    object."""
    parsed = json.loads(result.info_json) if result.info_json else {}
    return parsed if isinstance(parsed, dict) else {}


def answered(result: Any, step_info: Mapping[str, Any]) -> tuple[list[str], str]:
    """(the outputs of the calls the step ran, in order; its observation, "" without one) of a
    StepResult and its `info`."""
    outputs = step_info.get("tool_outputs") or []
    texts = [str(out.get("output", "")) for out in outputs if isinstance(out, Mapping)]
    observation = result.observation if result.HasField("observation") else ""
    return texts, observation
