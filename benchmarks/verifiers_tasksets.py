"""verifiers' own NeMo Gym taskset (`nemo_gym`) against ours (`nemo-gym-grpc-verifiers`), side
by side in one run (issue 30): episodes per second, and what each would train on when the
resources server fails some tool calls and verifies.

    .venv/bin/python -m benchmarks.verifiers_tasksets [--episodes 100] [--rounds 2]
        [--fail 0.05] [--out benchmarks/results]

(from the repository root). It starts the real agent stack (tests/support/agents.py: NeMo Gym
0.7.0's example_single_tool_call, unless NEMO_GYM_VERSION says otherwise, and the scripted
policy model), one bridge, and one verifiers 0.4 env server process per taskset
(tests/support/vf_env.py, the scripted chat harness of tests/support/vf_harness.py). Each
taskset reaches the resources server through a FaultProxy of its own with the same faults. The
`--episodes` episodes are the server's example rows, repeated, each with a marker field of its
own (`episode_marker`, sent with the row); per round, a seeded draw picks `--fail` of them whose
verify answers HTTP 503 and `--fail` more whose verify replies `mask_sample: true` (with
`reward: 0.0`, as NeMo Gym's judge_failsafe does), the same episodes for both tasksets; and the
first `--fail` of the tool calls answer HTTP 500. Each round runs both tasksets back to back, in
alternating order, every episode at once through one EnvClient.

Per taskset and round: seconds, episodes/s, traces verifiers would train on (no error; prime-rl
drops errored traces), and of those how many carry an injected failure (a masked sample, or a
tool call that failed) and with what reward. Per-round values go to --out
(verifiers_tasksets.json and .md), and the markdown is printed. Every server is stopped by its
recorded PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support import AgentStack, start_bridge
from tests.support.agents import WEATHER_RESOURCES
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.venv import ensure_venv, resources_server_dir
from tests.support.vf_env import TASKSET_ID, Served, run_episodes

OURS, THEIRS = TASKSET_ID, "nemo_gym"
MASKED = json.dumps(
    {
        "responses_create_params": {"input": []},
        "response": {},
        "reward": 0.0,
        "mask_sample": True,
        "failure_kind": "judge_failed",
    }
).encode()


def marker(episode: int) -> str:
    """The marker field value of episode `episode` (unique as a substring of a body)."""
    return f"vf-episode-{episode:05d}."


def dataset(example: Path, episodes: int, folder: Path) -> Path:
    """A JSONL of `episodes` rows: `example`'s rows in turn, each with its `episode_marker`."""
    rows = [json.loads(line) for line in example.read_text().splitlines() if line.strip()]
    path = folder / "episodes.jsonl"
    with path.open("w") as out:
        for k in range(episodes):
            out.write(json.dumps(rows[k % len(rows)] | {"episode_marker": marker(k)}) + "\n")
    return path


def faults(episodes: int, fail: float, seed: int) -> list[Fault]:
    """The round's faults (module docstring): the first tool calls answer 500; the verifies
    of seeded-drawn episodes 503, of as many others `mask_sample`."""
    count = round(episodes * fail)
    drawn = random.Random(seed).sample(range(episodes), 2 * count)
    unavailable = [
        Fault("status", path="/verify", match=marker(k), status=503, times=1) for k in drawn[:count]
    ]
    masked = [
        Fault("reply", path="/verify", match=marker(k), body=MASKED, times=1) for k in drawn[count:]
    ]
    return [Fault("status", path="/get_weather", status=500, times=count), *unavailable, *masked]


def _tool_failed(trace: Any) -> bool:
    """Whether a tool reply in `trace` is not the server's JSON (the injected 500)."""
    for message in trace.messages:
        if message.role == "tool" and not str(message.content or "").lstrip().startswith("{"):
            return True
    return False


def summarize(name: str, traces: list[Any], seconds: float) -> dict[str, Any]:
    """One taskset's round: counts and rewards of what it would train on."""
    trained = [t for t in traces if t.ok and not t.errors]
    masked = [t for t in trained if t.metrics.get("mask_sample")]
    tool_failed = [t for t in trained if _tool_failed(t)]
    return {
        "taskset": name,
        "episodes": len(traces),
        "seconds": round(seconds, 2),
        "episodes_per_s": round(len(traces) / seconds, 1),
        "trained": len(trained),
        "errored": len(traces) - len(trained),
        "trained_masked": len(masked),
        "trained_masked_rewards": sorted({t.reward for t in masked}),
        "trained_after_failed_tool": len(tool_failed),
        "trained_after_failed_tool_rewards": sorted({t.reward for t in tool_failed}),
        "trained_mean_reward": round(sum(t.reward for t in trained) / max(len(trained), 1), 3),
    }


def one_round(served: Served, proxy: FaultProxy, args: argparse.Namespace, k: int, url: str):
    """(traces, seconds) of every episode of `served` under round `k`'s faults."""
    proxy.set_faults(*faults(args.episodes, args.fail, seed=k))
    started = time.perf_counter()
    traces = asyncio.run(run_episodes(served.address, url, served.data))
    return traces, time.perf_counter() - started


def rounds(
    served: dict[str, tuple[Served, FaultProxy]], args: argparse.Namespace, model_url: str
) -> list[dict[str, Any]]:
    """Every round's summaries: both tasksets of `served` ({name: (env server, its proxy)})
    back to back, in alternating order."""
    rows: list[dict[str, Any]] = []
    for k in range(args.rounds):
        for name in [OURS, THEIRS] if k % 2 == 0 else [THEIRS, OURS]:
            traces, seconds = one_round(*served[name], args, k, model_url)
            rows.append({"round": k + 1, **summarize(name, traces, seconds)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start the stack, the proxies, the bridge and both env servers; run the rounds."""
    venv = ensure_venv()
    example = resources_server_dir(WEATHER_RESOURCES, venv) / "data" / "example.jsonl"
    with AgentStack(venv=venv) as stack, tempfile.TemporaryDirectory() as folder:
        rows_path = str(dataset(example, args.episodes, Path(folder)))
        upstream = stack.resources_urls[WEATHER_RESOURCES]
        with FaultProxy(upstream) as theirs_proxy, FaultProxy(upstream) as ours_proxy:
            route = f"{WEATHER_RESOURCES}={ours_proxy.url}"
            with start_bridge("--head-url", stack.head_url, "--server", route) as bridge:
                ours = {"bridge": bridge.target, "resources_server": WEATHER_RESOURCES}
                theirs = {"resources_url": theirs_proxy.url}
                served = {
                    OURS: (Served({"id": OURS, "dataset": rows_path, "task": ours}), ours_proxy),
                    THEIRS: (
                        Served({"id": THEIRS, "dataset": rows_path, "task": theirs}),
                        theirs_proxy,
                    ),
                }
                try:
                    return rounds(served, args, stack.policy.base_url)
                finally:
                    for server, _ in served.values():
                        server.stop()


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The rounds as a markdown table."""
    keys = [k for k in rows[0] if not k.endswith("_rewards")]
    lines = [
        f"verifiers tasksets, {args.episodes} episodes per round, faults {args.fail:.0%} each "
        "(tool 500, verify 503, verify mask_sample)",
        "",
        "| " + " | ".join(keys) + " | rewards trained on failures |",
        "|" + "---|" * (len(keys) + 1),
    ]
    for row in rows:
        failed = row["trained_masked_rewards"] + row["trained_after_failed_tool_rewards"]
        cells = [str(row[k]) for k in keys] + [str(sorted(set(failed)))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fail", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verifiers_tasksets.json").write_text(json.dumps(rows, indent=1))
    text = markdown(rows, args)
    (args.out / "verifiers_tasksets.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
