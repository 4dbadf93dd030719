"""A verifiers 0.4 taskset whose tasks live in NeMo Gym sessions opened through the bridge
(docs/verifiers.md): `BridgeTaskset` (`Taskset`), `BridgeTask`, `BridgeConfig`,
`BridgeTaskConfig`, `BridgeState`.

What a task does, against verifiers' own `NeMoGymTask` (verifiers/v1/tasksets/nemo_gym/): its
`setup` opens a session on the resources server through the bridge's `SessionService` (the
row seeded with `/seed_session`, the session pinned to the replica that seeded it), its tools
are called through the bridge (toolset.py), and its `nemo_gym` reward verifies in that session
and closes it (verifiers scores after `finalize`, so the verify is the session's last step; a
rollout that never reaches scoring leaves it to the bridge's `--session-lease`). A failed or
masked verify is never a reward: it raises `TaskError`, which verifiers records on the trace as
an error (prime-rl leaves errored traces out of training), with the bridge's failure in
`trace.info["nemo_gym"]`. Rows load with verifiers' own loader (`NeMoGymTaskset.load`), and
answers become Responses objects with its `trace_to_nemo_response`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
from pydantic import Field
from verifiers.v1.errors import TaskError
from verifiers.v1.mcp import SharedToolsetConfig, Toolset
from verifiers.v1.runtimes import Runtime
from verifiers.v1.state import State
from verifiers.v1.task import Task, TaskConfig
from verifiers.v1.taskset import Taskset, TasksetConfig
from verifiers.v1.tasksets.nemo_gym import NeMoGymData, NeMoGymTaskset
from verifiers.v1.tasksets.nemo_gym.response import trace_to_nemo_response
from verifiers.v1.trace import Trace
from verifiers.v1.utils.decorators import reward

from nemo_gym_grpc.rewards.client.sessions import SessionError
from nemo_gym_grpc.rewards.verifiers import clients

# reward == sum(reward_components) up to this much: then they are the named rewards
COMPONENTS_TOLERANCE = 1e-6


class BridgeTaskConfig(TaskConfig):
    """Where and how a task reaches NeMo Gym."""

    bridge: str = "127.0.0.1:50051"
    """The bridge's gRPC target (host:port; or `ray:` as for every client of ours)."""

    resources_server: str
    """The resources server's name in the bridge's NeMo Gym config (e.g. "mcqa")."""

    step_timeout: float = Field(60.0, gt=0)
    """Seconds each session step (open, tool call, verify, close) may take."""

    seed_kind: str = "auto"
    """"auto", "legacy" (cookie) or "typed" (NeMo Gym 0.7's typed seed): session.proto."""


class BridgeConfig(TasksetConfig):
    """The taskset's config: `dataset` is a NeMo Gym JSONL (rows with
    `responses_create_params`), as for verifiers' `nemo_gym` taskset."""

    dataset: Path
    tools: SharedToolsetConfig = SharedToolsetConfig()
    task: BridgeTaskConfig


class BridgeState(State):
    """One rollout's session, shared with the tool server process (toolset.py) as JSON."""

    bridge: str = ""
    session_id: str = ""
    step_timeout: float = 60.0
    direct_tools: dict[str, dict[str, Any]] = Field(default_factory=dict)
    tool_names: list[str] = Field(default_factory=list)
    tool_failures: list[dict[str, str]] = Field(default_factory=list)
    """Tool calls that failed for reasons not the model's (toolset.py): {tool, failure,
    message} each."""
    step_wise: bool = False
    """The session is an episode of a step-wise server (episodes.py plays it)."""
    observation: str = ""
    """A step-wise episode's first observation (the `/reset` reply's)."""
    step_rewards: list[float] = Field(default_factory=list)
    """The reward of each step so far."""
    episode_over: bool = False
    """The server ended the episode (terminated or truncated), and the bridge its session."""
    step_failure: dict[str, str] = Field(default_factory=dict)
    """A step that failed for reasons not the model's: {failure, message, ...}."""
    row: dict[str, Any] = Field(default_factory=dict)
    """A step-wise episode's dataset row (each `/step` sends it; empty otherwise)."""


class BridgeTask(Task[NeMoGymData, BridgeState, BridgeTaskConfig]):
    """One NeMo Gym row: seeded, its tools called and verified in one bridge session."""

    async def setup(self, trace: Trace, runtime: Runtime) -> None:
        """Open the session (`/seed_session` with the row); raises TaskError if it fails. A row
        without tools gets the server's own (the bridge's listing of them): a server that
        offers its tools over MCP may leave them out of its rows (example_mcp_weather)."""
        state = trace.state
        state.bridge, state.step_timeout = self.config.bridge, self.config.step_timeout
        tools = self.data.row["responses_create_params"].get("tools") or await self._listed(trace)
        state.direct_tools = {t["name"]: t for t in tools if t.get("type") == "function"}
        state.tool_names = list(state.direct_tools)
        client = clients.session_client(self.config.bridge)
        try:
            session = await client.open(
                self.config.resources_server,
                self.data.row,
                timeout=self.config.step_timeout,
                seed_kind=self.config.seed_kind,
            )
        except SessionError as exc:
            raise _failed(trace, "open", exc) from None
        state.session_id = session.id
        if session.step_wise:  # its tools (the row's) run in its steps: episodes.py
            state.step_wise, state.row = True, self.data.row
            state.observation = str(session.seed_reply.get("observation") or "")

    async def _listed(self, trace: Trace) -> list[dict[str, Any]]:
        """The server's tools as the bridge lists them; raises TaskError if that fails."""
        server = self.config.resources_server
        try:
            return await clients.server_tools(self.config.bridge, server, self.config.step_timeout)
        except grpc.aio.AioRpcError as exc:
            trace.info["nemo_gym"] = {"step": "tools", "failure": exc.code().name}
            raise TaskError(f"the bridge's tools of {server} failed: {exc.code().name}") from None

    @reward(weight=1.0)
    async def nemo_gym(self, trace: Trace) -> float | Mapping[str, float]:
        """The session's `/verify` reward. Its `reward_components`, when they sum to it (NeMo
        Gym's multi-reward convention, e.g. example_tool_call_multireward), are the named
        rewards instead; components that do not (diagnostics, e.g. nemo_user_sim's) are
        metrics `reward_component/<name>`. Raises TaskError for a failed or masked verify, and
        (closing the session unverified) when a tool call failed for reasons not the model's."""
        state = trace.state
        if state.step_wise:
            return await self._episode_reward(trace)
        if state.tool_failures:
            with contextlib.suppress(SessionError):  # the bridge's lease closes it otherwise
                await clients.close(state.bridge, state.session_id)
            trace.info["nemo_gym"] = {"step": "tool", **state.tool_failures[0]}
            failed = state.tool_failures[0]
            raise TaskError(f"NeMo Gym tool {failed['tool']} failed: {failed['failure']}")
        params = self.data.row["responses_create_params"]
        response = trace_to_nemo_response(trace, params, state.tool_names)
        request = clients.verify_request(
            state.session_id, response=response, row=self.data.row, close=True
        )
        try:
            result = await clients.verify(state.bridge, request, state.step_timeout)
        except SessionError as exc:
            raise _failed(trace, "verify", exc) from None
        trace.info["nemo_gym"] = {"latency_seconds": result.latency_seconds}
        components = dict(result.reward_components)
        total = sum(components.values())
        if components and math.isclose(total, result.reward, abs_tol=COMPONENTS_TOLERANCE):
            return components
        for name, value in components.items():
            trace.record_metric(f"reward_component/{name}", value)
        return result.reward

    async def _episode_reward(self, trace: Trace) -> float:
        """A step-wise episode's reward: the sum of its steps' (as NeMo Gym's gymnasium agent
        sums them); an episode the agent's turn limit cut short keeps what it earned and its
        session is closed. Raises TaskError when a step failed for reasons not the model's."""
        state = trace.state
        if not state.episode_over:
            with contextlib.suppress(SessionError):  # the bridge's lease closes it otherwise
                await clients.close(state.bridge, state.session_id)
        if state.step_failure:
            trace.info["nemo_gym"] = {"step": "step", **state.step_failure}
            raise TaskError(f"NeMo Gym step failed: {state.step_failure['failure']}")
        trace.record_metric("nemo_gym/steps", float(len(state.step_rewards)))
        trace.record_metric("nemo_gym/truncated", 0.0 if state.episode_over else 1.0)
        return float(sum(state.step_rewards))


def _failed(trace: Trace, step: str, exc: SessionError) -> TaskError:
    """The TaskError of a failed session `step`, its failure recorded in trace.info."""
    failure = exc.failure
    trace.info["nemo_gym"] = {
        "step": step,
        "failure": failure.cause,
        "message": failure.message,
        **dict(failure.metadata),
    }
    return TaskError(f"NeMo Gym {step} failed: {failure.cause}: {failure.message}")


class BridgeTaskset(Taskset[BridgeTask, BridgeConfig]):
    """NeMo Gym rows as verifiers tasks served through the bridge (module docstring)."""

    @classmethod
    def toolsets(cls, config: BridgeConfig) -> list[Toolset]:
        """The row's function tools, called in the rollout's session (toolset.py)."""
        from nemo_gym_grpc.rewards.verifiers.toolset import BridgeToolset

        return [BridgeToolset(config.tools)]

    def load(self) -> Iterator[BridgeTask]:
        """One task per row of `config.dataset`, read by verifiers' own NeMo Gym loader."""
        for task in NeMoGymTaskset.load(self):
            yield BridgeTask(task.data, self.config.task)
