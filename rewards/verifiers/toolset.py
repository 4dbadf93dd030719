"""The tools of a `BridgeTask` for verifiers' harnesses: an MCP tool server (verifiers runs it
as `python -m nemo_gym_grpc.rewards.verifiers.toolset`, one per env worker) whose catalog is the
row's function tools and whose calls go to the rollout's NeMo Gym session through the bridge's
`CallTool` (the session's cookies and replica stay with the bridge). In a step-wise episode
each call is a `/step` whose action is that call (`step_call`; episodes.py)."""

from __future__ import annotations

import json
import uuid
from typing import Any, cast

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult, TextContent, Tool
from verifiers.v1.mcp import SharedToolsetConfig, Toolset

from nemo_gym_grpc.rewards.client import steps
from nemo_gym_grpc.rewards.client.sessions import SessionError
from nemo_gym_grpc.rewards.verifiers import clients, episodes
from nemo_gym_grpc.rewards.verifiers.taskset import BridgeState

UNKNOWN_TOOL = "UNKNOWN_TOOL"  # the bridge's reason for a tool the server does not have


class BridgeToolset(Toolset[SharedToolsetConfig, BridgeState]):
    """The rollout's tools (`BridgeState.direct_tools`), called in its session."""

    TOOL_PREFIX = None

    def register(self, mcp: MCPServer) -> None:
        """Serve this rollout's catalog and calls (MCP's handlers call these two methods)."""
        server = cast(Any, mcp)
        server.list_tools = self._with_state(self.list_tools)
        server.call_tool = self._with_state(self.call_tool)

    async def list_tools(self) -> list[Tool]:
        """The row's function tools (name, description, JSON schema of the arguments)."""
        return [
            Tool(
                name=spec["name"],
                description=spec.get("description") or None,
                input_schema=spec.get("parameters") or {},
            )
            for spec in self.state.direct_tools.values()
        ]

    async def call_tool(
        self, name: str, arguments: dict[str, Any], context: Context | None = None
    ) -> CallToolResult:
        """The tool's JSON reply as text. A failed call is an MCP error result carrying the
        bridge's failure, for the model to see; one that is not the model's doing (anything
        but an unknown tool or arguments the server refused) is also recorded in the state's
        `tool_failures`, which makes the trace errored (taskset.py)."""
        state = self.state
        if state.step_wise:
            return await step_call(state, name, arguments)
        try:
            output = await clients.call_tool(
                state.bridge, state.session_id, name, arguments, state.step_timeout
            )
        except SessionError as exc:
            failure = exc.failure
            if failure.reason != UNKNOWN_TOOL and failure.code != "INVALID_ARGUMENT":
                state.tool_failures.append(
                    {"tool": name, "failure": failure.cause, "message": failure.message}
                )
            text = f"{failure.cause}: {failure.message}"
            return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)
        return CallToolResult(content=[TextContent(type="text", text=json.dumps(output))])


async def step_call(state: BridgeState, name: str, arguments: dict[str, Any]) -> CallToolResult:
    """A tool call in a step-wise episode: one `/step` whose action is a Responses object of
    that one `function_call`, which the server runs (NeMo Gym's gymnasium servers return its
    output in the step's `info["tool_outputs"]`). The text: that output, then the step's
    observation; the step's reward and end go into `state` (`episodes.took`). A failed step
    is an error result, and the trace is errored (`episodes.failed`)."""
    if state.episode_over or state.step_failure:
        return _text("the episode is over: no more tool calls", error=True)
    call = steps.function_call(name, arguments, f"call_{uuid.uuid4().hex[:16]}")
    params = state.row.get("responses_create_params") or {}
    response = steps.response([call], params, model="")
    try:
        result = await clients.step(
            state.bridge, state.session_id, state.row, state.step_timeout, response=response
        )
    except SessionError as exc:
        episodes.failed(state, exc)
        return _text(f"{exc.failure.cause}: {exc.failure.message}", error=True)
    texts, observation = steps.answered(result, steps.info(result))
    if observation:
        texts.append(observation)
    if episodes.took(state, result):
        texts.append("(the episode is over)")
    return _text("\n".join(texts))


def _text(text: str, error: bool = False) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=error)


if __name__ == "__main__":
    BridgeToolset.run()
