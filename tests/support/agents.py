"""A real NeMo Gym agent stack on loopback, with the scripted policy as the model's upstream.

    with AgentStack() as stack:                         # version None: env NEMO_GYM_VERSION
        stack.agent_urls["simple_agent"]                # POST /run with a weather row -> reward 1.0
        stack.environment_urls["single_agent_turn"]     # 0.7: episode POST /run
        stack.policy.knobs = Knobs(delay=0.5)           # the scripted policy (policy_model.py)

What runs (NeMo Gym's own `ng_run`, through NemoGymServers' extra_config):
- `policy_model`: NeMo Gym's `vllm_model` with `return_token_id_information: true` and
  `uses_reasoning_parser: false`, whose `base_url` is the ScriptedPolicy (the one stand-in).
- `simple_agent` (WEATHER_AGENT): NeMo Gym's `simple_agent` over the resources server
  `example_single_tool_call` and `policy_model`.
- 0.7 only, `single_agent_turn` (EPISODE_SERVER): the `single_agent_turn` environment server
  over that agent and resources server, tools granted by `direct_http`.
- 0.7 only, `math_agent` (MASKED_AGENT): `simple_agent` over `math_with_judge`
  (`should_use_judge: true`), whose judge model `judge_model` is an `openai_model` pointing at the
  policy's `/judge` routes, which answer 503. The policy answers a math prompt wrongly, so the
  judge is asked; 0.7's judge_failsafe then makes `/run` reply `mask_sample: true`,
  `failure_kind: "judge_failed"`, `reward: 0.0` (a placeholder).
- 0.7 only, `math_environment_server` (MASKED_RELAY): a `legacy_agent` relay to `math_agent`,
  declared here because 0.7 generates one for every agent no environment server names, and a
  generated one would get neither a loopback port from us nor the venv link ng_run needs
  offline. The weather agent is named by `single_agent_turn`, so it gets no relay.
0.4.0 has neither environment servers nor judge_failsafe: there the stack is `policy_model`
and the weather agent only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.policy_model import ScriptedPolicy
from tests.support.stack import NemoGymServers
from tests.support.venv import ensure_venv, venv_version
from tests.support.versions import version_tuple

POLICY_MODEL = "policy_model"
WEATHER_AGENT = "simple_agent"
WEATHER_RESOURCES = "example_single_tool_call"
EPISODE_SERVER = "single_agent_turn"
MASKED_AGENT = "math_agent"
MASKED_RESOURCES = "math_with_judge"
MASKED_RELAY = "math_environment_server"
JUDGE_MODEL = "judge_model"
EPISODE_TIMEOUT = 600.0  # s, single_agent_turn's bound on one episode (stock: 21600)
CLEANUP_TIMEOUT = 30.0  # s, its bound on closing the sessions (stock: 180; required in 0.7)


def _ref(kind: str, name: str) -> dict[str, str]:
    return {"type": kind, "name": name}


def _simple_agent(resources: str) -> dict[str, Any]:
    """A `simple_agent` block over resources server `resources` and POLICY_MODEL."""
    return {
        "responses_api_agents": {
            "simple_agent": {
                "resources_server": _ref("resources_servers", resources),
                "model_server": _ref("responses_api_models", POLICY_MODEL),
            }
        }
    }


def _policy_and_weather_blocks(policy: ScriptedPolicy) -> dict[str, Any]:
    """extra_config blocks of every version: POLICY_MODEL over `policy`, WEATHER_AGENT."""
    vllm = {
        "base_url": policy.base_url,
        "api_key": "dummy",
        "model": "scripted-policy",
        "return_token_id_information": True,
        "uses_reasoning_parser": False,
    }
    return {
        POLICY_MODEL: {"responses_api_models": {"vllm_model": vllm}},
        WEATHER_AGENT: _simple_agent(WEATHER_RESOURCES),
    }


def _episode_and_masked_blocks(policy: ScriptedPolicy) -> tuple[dict, dict]:
    """(config_overrides, extra_config) that 0.7 adds: EPISODE_SERVER, and the masked path
    (JUDGE_MODEL on `policy`'s judge routes, MASKED_AGENT, MASKED_RELAY, MASKED_RESOURCES asking
    the judge)."""
    extra: dict[str, Any] = {
        EPISODE_SERVER: {
            "environment_servers": {
                "single_agent_turn": {
                    "resources_server": _ref("resources_servers", WEATHER_RESOURCES),
                    "agent_server": _ref("responses_api_agents", WEATHER_AGENT),
                    "resources_tool_transports": ["direct_http"],
                    "default_episode_timeout_seconds": EPISODE_TIMEOUT,
                    "cleanup_timeout_seconds": CLEANUP_TIMEOUT,
                }
            }
        }
    }
    judge = {
        "openai_base_url": policy.judge_base_url,
        "openai_api_key": "dummy",
        "openai_model": "judge",
    }
    extra[JUDGE_MODEL] = {"responses_api_models": {"openai_model": judge}}
    extra[MASKED_AGENT] = _simple_agent(MASKED_RESOURCES)
    relay = {"agent_server": _ref("responses_api_agents", MASKED_AGENT)}
    extra[MASKED_RELAY] = {"environment_servers": {"legacy_agent": relay}}
    overrides = {
        MASKED_RESOURCES: {
            "should_use_judge": True,
            "judge_model_server": _ref("responses_api_models", JUDGE_MODEL),
            "judge_responses_create_params": {"input": []},
        }
    }
    return overrides, extra


def stack_config(policy: ScriptedPolicy, version: str) -> tuple[tuple[str, ...], dict, dict]:
    """(resources servers, config_overrides, extra_config) for NemoGymServers: the blocks the
    module docstring lists, for NeMo Gym `version`."""
    extra = _policy_and_weather_blocks(policy)
    if version_tuple(version) < (0, 7):
        return (WEATHER_RESOURCES,), {}, extra
    overrides, more = _episode_and_masked_blocks(policy)
    return (WEATHER_RESOURCES, MASKED_RESOURCES), overrides, {**extra, **more}


class AgentStack:
    """The ScriptedPolicy plus ng_run with the agent stack of the module docstring.

    After start() (or entering the context):
        head_url: the head server's URL.
        agent_urls: {agent instance: URL} (WEATHER_AGENT; on 0.7 also MASKED_AGENT).
        environment_urls: {environment server instance: URL} (0.7: EPISODE_SERVER, MASKED_RELAY;
            {} on 0.4).
        resources_urls: {resources server: URL}.
        model_urls: {model server instance: URL} (POLICY_MODEL; on 0.7 also JUDGE_MODEL).
        policy: the ScriptedPolicy (knobs, request log).
        version: the NeMo Gym version.
        gym: the NemoGymServers (log_tail(), startup_seconds, ...).
    Raises what NemoGymServers.start() raises (NemoGymError) if the stack does not come up.
    """

    def __init__(
        self,
        *,
        venv: str | Path | None = None,
        version: str | None = None,
        startup_timeout: float = 240.0,
    ) -> None:
        self._venv = venv
        self._version = version
        self._startup_timeout = startup_timeout
        self.policy = ScriptedPolicy()
        self.gym: NemoGymServers | None = None
        self.head_url = ""
        self.version = ""
        self.agent_urls: dict[str, str] = {}
        self.environment_urls: dict[str, str] = {}
        self.resources_urls: dict[str, str] = {}
        self.model_urls: dict[str, str] = {}

    def __enter__(self) -> AgentStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"AgentStack(version={self.version!r}, head={self.head_url!r})"

    def start(self) -> AgentStack:
        """Start the policy, then ng_run; wait until every server answers."""
        venv = Path(self._venv or ensure_venv(version=self._version))
        version = venv_version(venv)
        self.policy.start()
        try:
            servers, overrides, extra = stack_config(self.policy, version)
            self.gym = NemoGymServers(
                servers,
                venv=venv,
                version=version,
                startup_timeout=self._startup_timeout,
                config_overrides=overrides,
                extra_config=extra,
            )
            self.gym.start()
        except BaseException:
            self.policy.stop()
            raise
        self.version = version
        self.head_url = self.gym.head_url
        kinds = {name: next(iter(block)) for name, block in extra.items()}
        urls = self.gym.server_urls
        self.resources_urls = {name: urls[name] for name in servers}
        self.agent_urls = self._of_kind(kinds, "responses_api_agents")
        self.environment_urls = self._of_kind(kinds, "environment_servers")
        self.model_urls = self._of_kind(kinds, "responses_api_models")
        return self

    def _of_kind(self, kinds: dict[str, str], kind: str) -> dict[str, str]:
        assert self.gym is not None
        return {name: self.gym.server_urls[name] for name, k in kinds.items() if k == kind}

    def stop(self) -> None:
        """Stop ng_run (NemoGymServers.stop), then the policy. Idempotent."""
        try:
            if self.gym is not None:
                self.gym.stop()
        finally:
            self.policy.stop()
