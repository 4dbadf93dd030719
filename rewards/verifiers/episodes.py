"""Step-wise NeMo Gym servers in verifiers: `BridgeEnv`, the env of the taskset
`nemo-gym-grpc-verifiers` (verifiers' loader takes the `Env` a taskset's package exports).

A step-wise server (NeMo Gym 0.7's gymnasium-style servers: `/reset` and `/step`, no
`/verify`; blackjack, example_multi_turn_gymnasium, ...) drives its own episode. `BridgeEnv`
plays one as NeMo Gym's own gymnasium agent does, through the bridge's session: the task's
setup resets it (OpenSession); the row's prompt and the first observation (as a `user`
message) open the exchange (verifiers' `Interaction`); each reply of the model is the action of
one `/step` (Step, the reply's text), whose observation is the next `user` turn, until the
server terminates or truncates the episode or the agent's turn limit ends the exchange. The
task's reward is then the sum of its steps' rewards (`BridgeTask._episode_reward`); a step
that fails for reasons not the model's ends the exchange and errors the trace (TaskError).

A server whose steps run the model's function calls (wordle, openair_congestion: the row's
tools) gets each tool call the harness makes as a step of its own (toolset.py: a Responses
object of that one `function_call`), its output the call's result; a reply without a tool call
is a step of its text, as above.

Every other task is played as verifiers' `SingleAgentEnv` plays it (its config, `agent`, is
the same).
"""

from __future__ import annotations

from typing import Any

import grpc
from verifiers.v1.agent import Agent, Agents
from verifiers.v1.envs.single_agent import SingleAgentEnv
from verifiers.v1.task import Task

from nemo_gym_grpc.rewards.client.sessions import SessionError
from nemo_gym_grpc.rewards.verifiers import clients
from nemo_gym_grpc.rewards.verifiers.taskset import BridgeTask


class BridgeEnv(SingleAgentEnv):
    """One `agent` seat over the taskset; a task on a step-wise server played step by step
    (module docstring), any other as `SingleAgentEnv` plays it."""

    async def run(self, task: Task, agents: Agents) -> None:
        """Play `task` with `agents.agent`. Raises what verifiers raises for its rollout;
        a failure of NeMo Gym's is the trace's error, recorded by the task."""
        if isinstance(task, BridgeTask) and await _step_wise(task):
            await play(task, agents.agent)
        else:
            await super().run(task, agents)


async def _step_wise(task: BridgeTask) -> bool:
    """Whether the bridge lists the task's resources server as step-wise (asked before the
    rollout opens: the two kinds of task are played differently from their first turn).
    False when the bridge cannot be asked: the task's setup then fails as it did before,
    typed, on its trace."""
    config = task.config
    try:
        return await clients.step_wise(config.bridge, config.resources_server, config.step_timeout)
    except grpc.aio.AioRpcError:
        return False


async def play(task: BridgeTask, agent: Agent) -> None:
    """One episode of a step-wise server (module docstring)."""
    opening = list(task.data.prompt or [])
    unprompted = type(task)(task.data.model_copy(update={"prompt": None}), task.config)
    async with agent.interaction(unprompted) as exchange:
        # the tool server replaces the state object as it writes it: read it anew each time
        if exchange.trace.state.observation:
            opening.append({"role": "user", "content": exchange.trace.state.observation})
        segment = await exchange.turn(opening)
        while not segment.terminated:
            observation = await act(exchange.trace.state, segment.last_reply)
            if observation is None:
                break
            segment = await exchange.turn(observation)


async def act(state: Any, text: str) -> str | None:
    """The server's `/step` with the model's reply `text` (`state`: the task's BridgeState):
    the next `user` turn (its observation; "" when it sent none), or None when the episode is
    over (the server ended it, possibly in a tool call's step; or a step failed:
    `state.step_failure`)."""
    if state.episode_over or state.step_failure:
        return None
    try:
        result = await clients.step(
            state.bridge, state.session_id, state.row, state.step_timeout, completion=text
        )
    except SessionError as exc:
        failed(state, exc)
        return None
    if took(state, result):
        return None
    return result.observation if result.HasField("observation") else ""


def took(state: Any, result: Any) -> bool:
    """Record one step's `result` (a StepResult) in `state`; whether it ended the episode."""
    state.step_rewards.append(float(result.reward))
    ended = bool(result.terminated or result.truncated)
    state.episode_over = ended
    return ended


def failed(state: Any, exc: SessionError) -> None:
    """Record a step that failed for reasons not the model's (the trace is errored)."""
    failure = exc.failure
    state.step_failure = {
        "failure": failure.cause,
        "message": failure.message,
        **dict(failure.metadata),
    }
