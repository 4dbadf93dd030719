"""`NemoGymEnv`: a SkyRL gym environment (skyrl-gym 0.4 `BaseTextEnv`) whose episode is a NeMo
Gym session through the bridge (docs/skyrl.md).

- `init(prompt)` opens the session: `/seed_session` with the row (`OpenSession`);
- `step(action)` runs the tool calls in the model's text (`turns.tool_calls`, each a `CallTool`
  in the session) and answers their outputs as `tool` messages; a turn without tool calls (or
  the `max_turns`-th) ends the episode: `/verify` of the whole episode as a Responses object,
  in the session, closed after; its reward is the step's;
- `close()` closes a session still open (an episode cut short).

On a step-wise server (NeMo Gym 0.7's gymnasium-style servers: `/reset` and `/step`, e.g.
blackjack, wordle) the episode is the server's, as NeMo Gym's own gymnasium agent drives it:
`init` resets it and adds the first observation to the prompt as a `user` message; `step` sends
each model turn to `/step` (the bridge's `Step`) as a Responses object (its text, and its tool
calls as `function_call` items, which the server runs) and answers with the tool outputs the
step returned (`tool` messages) and the next observation (`user`); its reward is the step's
(SkyRL places each at the end of its turn); the episode ends when the server terminates or
truncates it, or at the `max_turns`-th turn (the session is then closed).

The row comes in `extras` (SkyRL passes every dataset column but the prompt there):
`nemo_gym_row` (the NeMo Gym dataset row, a dict or its JSON text) and `resources_server` (its
resources server's name). The bridge: `env_config["bridge"]`, else `NEMO_GYM_GRPC_TARGET`, else
an embedded bridge on `NEMO_GYM_HEAD_URL` (rewards/client/settings.py).

A step that fails for reasons not the model's (the session cannot be opened or was lost, a tool
or `/verify` failed upstream, a masked sample) raises `NemoGymEnvError`, never returns a reward:
SkyRL's generator has no way for an env to mask a sample, and a reward of 0.0 would train; the
session is closed first (SkyRL's agent loop does not close an env whose step raised). A
tool call that is the model's mistake (no such tool, arguments the server refuses, a malformed
call) is answered to the model as the tool's output, and the episode goes on.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from nemo_gym_grpc.rewards.client import embedded, settings, steps
from nemo_gym_grpc.rewards.client.sessions import Session, SessionClient, SessionError
from nemo_gym_grpc.rewards.skyrl.turns import Episode, ToolCall, tool_calls

DEFAULT_MAX_TURNS = 8
DEFAULT_STEP_TIMEOUT = 60.0  # seconds per session call
UNKNOWN_TOOL = "UNKNOWN_TOOL"  # the bridge's reason for a tool the server does not have

_clients: dict[str, SessionClient] = {}
_clients_lock = threading.Lock()


class NemoGymEnvError(RuntimeError):
    """A step that failed for reasons not the model's; `failure` is the bridge's typed one
    (`outcomes.Failure`) and `step` says which ("open", "tool", "verify", "step")."""

    def __init__(self, step: str, exc: SessionError) -> None:
        super().__init__(f"NeMo Gym {step} failed: {exc}")
        self.step, self.failure = step, exc.failure


def client_of(target: str) -> SessionClient:
    """This process's session client of the bridge at `target` (one channel, shared by every
    env; SkyRL runs envs on a thread pool, and a gRPC channel is thread-safe)."""
    with _clients_lock:
        if target not in _clients:
            _clients[target] = SessionClient(target)
        return _clients[target]


class NemoGymEnv(BaseTextEnv):
    """One NeMo Gym row as a SkyRL episode (module docstring).

    Args:
        env_config: `bridge` (target), `step_timeout` (seconds, default 60), `max_turns`.
        extras: `nemo_gym_row`, `resources_server`, and optionally `max_turns` (SkyRL's
            generator sets it from its config), which wins over env_config's (default 8).

    Raises:
        ValueError: `extras` lacks the row or the server's name.
    """

    def __init__(self, env_config: Mapping[str, Any] | None = None, extras: Any = None) -> None:
        super().__init__()
        config, extras = dict(env_config or {}), dict(extras or {})
        row = extras.get("nemo_gym_row")
        self.row: dict[str, Any] = json.loads(row) if isinstance(row, str) else dict(row or {})
        self.server = str(extras.get("resources_server") or "")
        if not self.row or not self.server:
            raise ValueError("NemoGymEnv needs extras nemo_gym_row and resources_server")
        turns = extras.get("max_turns") or config.get("max_turns") or DEFAULT_MAX_TURNS
        self.max_turns = int(turns)
        self.timeout = float(config.get("step_timeout", DEFAULT_STEP_TIMEOUT))
        self.target = str(config.get("bridge") or "") or None
        self.session: Session | None = None
        self.episode = Episode()
        self.tool_calls = 0
        self.model_mistakes = 0

    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        """Open the session; the prompt goes to the model unchanged.

        Raises:
            NemoGymEnvError: the session could not be opened.
        """
        target = self.target or settings.target()
        target = target or embedded.ensure_bridge(embedded.head_server_spec())
        try:
            self.session = client_of(target).open(self.server, self.row, timeout=self.timeout)
        except SessionError as exc:
            raise NemoGymEnvError("open", exc) from None
        observation = self.session.seed_reply.get("observation")
        if self.session.step_wise and observation:
            prompt = [*prompt, {"role": "user", "content": str(observation)}]
        return prompt, {"nemo_gym_session": self.session.id}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """One model turn (module docstring). Raises NemoGymEnvError."""
        self.turns += 1
        assert self.session is not None, "init() opens the session"
        if self.session.step_wise:
            return self._stepped(action)
        calls = tool_calls(action)
        if not calls or self.turns >= self.max_turns:
            return self._verified(action)
        observations = [{"role": "tool", "content": self._run(call)} for call in calls]
        return BaseTextEnvStepOutput(
            observations=observations, reward=0.0, done=False, metadata={"tool_calls": len(calls)}
        )

    def close(self) -> None:
        """Close the session if the episode ended before its verify."""
        session, self.session = self.session, None
        if session is not None:
            try:
                session.close()
            except SessionError:
                pass  # the bridge's lease closes it upstream

    def get_metrics(self) -> dict[str, Any]:
        """The episode's turns, tool calls, and tool calls that were the model's mistake."""
        return {
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "tool_mistakes": self.model_mistakes,
        }

    def _run(self, call: ToolCall | str) -> str:
        """The text of one tool call's output (or of the model's mistake)."""
        if isinstance(call, str):
            self.model_mistakes += 1
            return call
        assert self.session is not None, "init() opens the session"
        self.tool_calls += 1
        try:
            result = json.dumps(self.session.call_tool(call.name, call.arguments, self.timeout))
        except SessionError as exc:
            failure = exc.failure
            if failure.reason != UNKNOWN_TOOL and failure.code != "INVALID_ARGUMENT":
                self.close()  # SkyRL's agent loop does not close an env whose step raised
                raise NemoGymEnvError("tool", exc) from None
            self.model_mistakes += 1
            result = f"{exc.failure.cause}: {exc.failure.message}"
        self.episode.called(call, result)
        return result

    def _stepped(self, text: str) -> BaseTextEnvStepOutput:
        """The server's `/step` of one model turn in a step-wise episode."""
        assert self.session is not None, "init() opens the session"
        turn, mistakes = Episode(), []
        turn.said(text)
        for call in tool_calls(text):
            if isinstance(call, str):
                mistakes.append({"role": "tool", "content": call})
            else:
                turn.calling(call)
        self.tool_calls += len(turn.output) - 1
        self.model_mistakes += len(mistakes)
        response = turn.response(self.row.get("responses_create_params") or {})
        try:
            result = self.session.step(response=response, row=self.row, timeout=self.timeout)
        except SessionError as exc:
            self.close()
            raise NemoGymEnvError("step", exc) from None
        info = steps.info(result)
        ended = result.terminated or result.truncated
        if ended:
            self.session = None  # the server ended its episode, and the bridge its session
        elif self.turns >= self.max_turns:
            self.close()
        observations = [] if self.session is None else mistakes + _observations(result, info)
        metadata = {"terminated": result.terminated, "truncated": result.truncated, "info": info}
        return BaseTextEnvStepOutput(
            observations=observations, reward=float(result.reward),
            done=self.session is None, metadata=metadata,
        )  # fmt: skip

    def _verified(self, text: str) -> BaseTextEnvStepOutput:
        assert self.session is not None, "init() opens the session"
        self.episode.said(text)
        response = self.episode.response(self.row.get("responses_create_params") or {})
        try:
            result = self.session.verify(
                response=response, row=self.row, close=True, timeout=self.timeout
            )
        except SessionError as exc:
            self.close()
            raise NemoGymEnvError("verify", exc) from None
        self.session = None  # closed by the verify
        components = dict(result.reward_components)
        return BaseTextEnvStepOutput(
            observations=[], reward=float(result.reward), done=True,
            metadata={"reward_components": components} if components else {},
        )  # fmt: skip


def _observations(result: Any, info: Mapping[str, Any]) -> list[dict[str, str]]:
    """What a step-wise server answered to a turn, as chat messages: the outputs of the calls
    its step ran (`tool`), then its observation (`user`)."""
    outputs, observation = steps.answered(result, info)
    messages = [{"role": "tool", "content": text} for text in outputs]
    if observation:
        messages.append({"role": "user", "content": observation})
    return messages
