"""A SkyRL env calling NeMo Gym directly with `requests` (what a user writes today) against
`NemoGymEnv` (through the bridge), side by side in one run (issue 31): steps per second with 64
envs in flight, on the same rows.

    .venv/bin/python -m benchmarks.skyrl_envs [--episodes 512] [--workers 64] [--rounds 3]
        [--out benchmarks/results]

(from the repository root). It starts NeMo Gym's example_single_tool_call (0.7.0 unless
NEMO_GYM_VERSION says otherwise) and one bridge with its defaults. Each episode is what SkyRL's
agent loop does with an env: `init` (`/seed_session`), a step whose text calls `get_weather`,
a closing step (`/verify` of the episode); both envs build the same Responses object
(rewards/skyrl/turns.py), so only the way to NeMo Gym differs. `--workers` threads run the
episodes, as SkyRL's `max_env_workers` thread pool does. Each round runs both envs back to
back, in alternating order. Per env and round: seconds, episodes/s, steps/s (`init` and both
`step`s), and episodes that failed or scored other than 1.0. Results go to --out
(skyrl_envs.json, .md). Every server is stopped by its recorded PID.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from benchmarks.tables import write_rows
from nemo_gym_grpc.rewards.skyrl.env import NemoGymEnv
from nemo_gym_grpc.rewards.skyrl.turns import Episode, ToolCall, tool_calls
from tests.support import NemoGymServers, example_rows, start_bridge

SERVER = "example_single_tool_call"
TURNS = ['<tool_call>{"name": "get_weather", "arguments": {"city": "sf"}}</tool_call>', "Cold."]
STEPS_PER_EPISODE = 3  # init and two steps


class DirectEnv(BaseTextEnv):
    """The env a user writes today: `requests` straight to the resources server, the session
    cookie carried by hand, 60 s per call, no retries."""

    def __init__(self, url: str, row: dict[str, Any]) -> None:
        super().__init__()
        self.url, self.row, self.episode = url, row, Episode()
        self.cookies: Any = None
        self.max_turns = 4

    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        reply = requests.post(f"{self.url}/seed_session", json=self.row, timeout=60)
        reply.raise_for_status()
        self.cookies = reply.cookies
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        calls = [c for c in tool_calls(action) if isinstance(c, ToolCall)]
        if not calls:
            self.episode.said(action)
            body = dict(
                self.row, response=self.episode.response(self.row["responses_create_params"])
            )
            reply = requests.post(f"{self.url}/verify", json=body, cookies=self.cookies, timeout=60)
            reply.raise_for_status()
            return BaseTextEnvStepOutput(
                observations=[], reward=reply.json()["reward"], done=True, metadata={}
            )
        observations = []
        for call in calls:
            reply = requests.post(
                f"{self.url}/{call.name}", json=call.arguments, cookies=self.cookies, timeout=60
            )
            reply.raise_for_status()
            self.episode.called(call, reply.text)
            observations.append({"role": "tool", "content": reply.text})
        return BaseTextEnvStepOutput(observations=observations, reward=0.0, done=False, metadata={})


def one_episode(env: Any) -> float | None:
    """Run TURNS through `env`; the reward, or None when a call failed."""
    try:
        env.init([{"role": "user", "content": "..."}])
        for text in TURNS:
            out = env.step(text)
            if out["done"]:
                return float(out["reward"])
        return None
    except Exception:  # noqa: BLE001 - counted as a failed episode
        return None
    finally:
        env.close()


def run(make: Any, episodes: int, workers: int) -> dict[str, Any]:
    """`episodes` episodes of envs from `make(k)` on `workers` threads; the round's figures."""
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        rewards = list(pool.map(lambda k: one_episode(make(k)), range(episodes)))
    seconds = time.perf_counter() - started
    return {
        "seconds": round(seconds, 2),
        "episodes_per_s": round(episodes / seconds, 1),
        "steps_per_s": round(episodes * STEPS_PER_EPISODE / seconds, 1),
        "failed": sum(r is None for r in rewards),
        "not_one": sum(r is not None and r != 1.0 for r in rewards),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=512)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    rows = example_rows(SERVER)
    results: list[dict[str, Any]] = []
    with NemoGymServers((SERVER,)) as gym, start_bridge("--head-url", gym.head_url) as bridge:
        url = gym.server_urls[SERVER]
        envs = {
            "direct (requests)": lambda k: DirectEnv(url, rows[k % len(rows)]),
            "NemoGymEnv (bridge)": lambda k: NemoGymEnv(
                {"bridge": bridge.target},
                {"nemo_gym_row": rows[k % len(rows)], "resources_server": SERVER},
            ),
        }
        for round_ in range(args.rounds):
            names = list(envs) if round_ % 2 == 0 else list(reversed(envs))
            for name in names:
                row = {
                    "round": round_ + 1,
                    "env": name,
                    **run(envs[name], args.episodes, args.workers),
                }
                results.append(row)
                print(json.dumps(row), flush=True)
    print(write_rows(args.out, "skyrl_envs", results), end="")


if __name__ == "__main__":
    main()
