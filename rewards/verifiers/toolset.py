"""The tools of a `BridgeTask` for verifiers' harnesses: an MCP tool server (verifiers runs it
as `python -m nemo_gym_grpc.rewards.verifiers.toolset`, one per env worker) whose catalog is the
row's function tools and whose calls go to the rollout's NeMo Gym session through the bridge's
`CallTool` (the session's cookies and replica stay with the bridge)."""

from __future__ import annotations

import json
from typing import Any, cast

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult, TextContent, Tool
from verifiers.v1.mcp import SharedToolsetConfig, Toolset

from nemo_gym_grpc.rewards.client.sessions import SessionError
from nemo_gym_grpc.rewards.verifiers import clients
from nemo_gym_grpc.rewards.verifiers.taskset import BridgeState


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
        """The tool's JSON reply as text; a failed call (unknown tool, session lost, upstream
        error) is an MCP error result carrying the bridge's failure, for the model to see."""
        state = self.state
        try:
            output = await clients.call_tool(
                state.bridge, state.session_id, name, arguments, state.step_timeout
            )
        except SessionError as exc:
            text = f"{exc.failure.cause}: {exc.failure.message}"
            return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)
        return CallToolResult(content=[TextContent(type="text", text=json.dumps(output))])


if __name__ == "__main__":
    BridgeToolset.run()
