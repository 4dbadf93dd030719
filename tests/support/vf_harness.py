"""A verifiers 0.4 harness for the tests: the chat loop of verifiers' `null` harness, run
in-process. Why a stand-in: verifiers' stock harnesses launch their program as a `uv run`
script that installs its packages at run time, and this machine has no uv and no downloads at
test time; verifiers allows an in-process loop as long as every model call goes through the
rollout's interception endpoint (`Harness.launch`), which this one does. The model behind that
endpoint is tests/support/policy_model.py's scripted policy.

Loaded by id `vf_scripted_chat` (`install()` puts this module under that top-level name, as
verifiers' loader imports a harness id as one module that exports its `Harness` in `__all__`).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from openai import AsyncOpenAI
from verifiers.v1.clients import ModelContext
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harness import Harness
from verifiers.v1.harnesses.utils.mcp import mcp_client
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace

HARNESS_ID = "vf_scripted_chat"
MAX_TURNS = 8

__all__ = ["ScriptedChatHarness", "ScriptedChatConfig"]


class ScriptedChatConfig(HarnessConfig):
    """No settings of its own."""


class ScriptedChatHarness(Harness[ScriptedChatConfig]):
    """Chat completions through the interception endpoint; each tool call the model makes is
    called on the rollout's MCP tool servers and its text sent back, until the model answers
    without one (or MAX_TURNS)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True  # a later turn relaunches the loop on the conversation so far
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: ModelContext,
        trace: Trace,
        runtime: Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: TaskData,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages.extend(message_to_wire(m) for m in prompt or [])
        async with AsyncOpenAI(base_url=endpoint, api_key=secret) as llm:
            for _ in range(MAX_TURNS):
                tools = await _tools(mcp_urls)
                reply = await llm.chat.completions.create(
                    model=ctx.model, messages=messages, **({"tools": tools} if tools else {})
                )
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    text = await _call(mcp_urls, call.function.name, call.function.arguments)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
        return ProgramResult(exit_code=0, stdout="", stderr="")


async def _tools(mcp_urls: dict[str, str]) -> list[dict[str, Any]]:
    """The tools of every MCP server, as Chat Completions function tools."""
    tools = []
    for url in mcp_urls.values():
        async with mcp_client({"url": url}) as client:
            for tool in (await client.list_tools()).tools:
                function = {"name": tool.name, "parameters": tool.input_schema}
                tools.append({"type": "function", "function": function})
    return tools


async def _call(mcp_urls: dict[str, str], name: str, arguments: str) -> str:
    """The text of calling tool `name` (on the first server that lists it)."""
    for url in mcp_urls.values():
        async with mcp_client({"url": url}) as client:
            if any(t.name == name for t in (await client.list_tools()).tools):
                result = await client.call_tool(name, json.loads(arguments or "{}"))
                return "".join(getattr(part, "text", "") for part in result.content)
    return f"no such tool: {name}"


def serve(config_data: dict[str, Any], address_queue: Any) -> None:
    """A process's verifiers env server (`verifiers.v1.serve.serve_env`, one EnvServer, as
    prime-rl runs one per source) for the env config `config_data` (`env_config_data`), its
    address put on `address_queue`; this harness installed first. For
    `multiprocessing.get_context("spawn").Process(target=serve, ...)`."""
    from verifiers.v1.serve import serve_env

    install()
    serve_env(
        max_workers=1,
        config_data=config_data,
        address="tcp://127.0.0.1:0",
        address_queue=address_queue,
    )


def install() -> str:
    """Make this module importable as harness id HARNESS_ID; returns the id."""
    sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
    return HARNESS_ID
