"""Scenario 6 (issue 37): what each path costs a real NeMo Gym server. Real mcqa (one uvicorn
process, CPU-bound), the server's own CPU (user + system) per item and items/s for the direct
aiohttp fan-out (64 connections, the yardstick; `direct_16` and `direct_256`: the same client at
16 and 256 connections), for `reward_nemo_gym_verify` through
bridges that differ in one flag each, and for several bridges in front of the one server at
once (`two_bridges`, `four_bridges`: as on that many Ray nodes, each told so with
`--sharing-bridges`; `four_bridges_unshared`: not told); rounds rotate the order of the paths.

    python -m benchmarks.server_cost [--version 0.7.0] [--pinned] [--rounds 5] [--items 1000]
                                     [--paths defaults,fixed_256,fixed_8,...]
                                     [--code before=../before ...]

`--pinned`: the server's threads on CPU 0, this process (the callers) and every bridge on
CPU 1, so that the server's CPU is its own and not what the callers leave it. Ratios are
taken within a round (each path against the round's direct run), then the median over rounds.

`--code NAME=CHECKOUT` also runs every path from another checkout's code (laid out as
installed and put on the bridges' PYTHONPATH; its generated code made, `make proto`), named
`NAME:path`, in the same rounds: two versions of the bridge measured side by side, as the
rounds' spread between separate runs (+-10%) hides what a change does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import psutil

from benchmarks import clients, procs, scenarios
from benchmarks.clients import Item
from nemo_gym_grpc.rewards.client import stream
from nemo_gym_grpc.rewards.client.outcomes import Failure
from tests.support import NemoGymServers, example_rows, start_bridge
from tests.support.layout import laid_out_elsewhere

# Path name -> the bridge flags that make it (the table).
PATHS: dict[str, tuple[str, ...]] = {
    "defaults": (),
    "fixed_256": ("--fixed-concurrency", "256"),
    "aiohttp": ("--upstream-client", "aiohttp"),
    "no_rollout_correlation": ("--no-rollout-correlation",),
    **{f"fixed_{n}": ("--fixed-concurrency", str(n)) for n in (64, 32, 16, 8, 4)},
}
# Path name -> (how many bridges share the server, each one's flags): told how many share it
# (as the Ray fleet starts them), or with their defaults.
SHARED: dict[str, tuple[int, tuple[str, ...]]] = {
    "two_bridges": (2, ("--sharing-bridges", "2")),
    "four_bridges": (4, ("--sharing-bridges", "4")),
    "four_bridges_unshared": (4, ()),
}
DIRECT_CONCURRENCY = 64
# Path name -> the direct fan-out's own concurrency: the yardstick's curve, so that each run
# shows what concurrency alone saves the server against C = DIRECT_CONCURRENCY.
DIRECT: dict[str, int] = {"direct_16": 16, "direct_256": 256}
ALL_PATHS = [*PATHS, *SHARED, *DIRECT]
SERVER_CPUS, CALLER_CPUS = {0}, {1}


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` and of its descendants on `cpus` (threads started later inherit
    their creator's set)."""
    for proc in procs.tree(pid):
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except (ProcessLookupError, PermissionError):
                continue


def server_pid(gym: NemoGymServers, name: str) -> int:
    """The process of ng_run's tree that listens on the resources server's port."""
    port = int(gym.server_urls[name].rsplit(":", 1)[1])
    for proc in procs.tree(gym.pid or 0):
        try:
            listening = proc.net_connections(kind="tcp")
        except psutil.Error:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in listening):
            return proc.pid
    raise RuntimeError(f"no process of ng_run listens on {port}")


def shared(targets: Sequence[str], items: Sequence[Item]) -> list[float | None]:
    """`items` through several bridges in front of one server at once: item i to bridge i mod
    n, each bridge's part one `VerifyStream` (the requests the reward function builds, sent
    on its route); the rewards in the items' order (None for a failure)."""
    count = len(targets)

    def score(index: int) -> list[float | None]:
        requests = clients.grpc_requests(items[index::count], batch_id=f"bridge{index}")
        outcomes = stream.Route.resolve(target=targets[index], timeout=600.0).send(
            stream.VERIFY, requests
        )
        got = [outcomes[r.request_id] for r in requests]
        return [None if isinstance(o, Failure) else o.reward for o in got]

    rewards: list[float | None] = [None] * len(items)
    with ThreadPoolExecutor(count) as pool:
        for index, part in enumerate(pool.map(score, range(count))):
            rewards[index::count] = part
    return rewards


def _measure(
    server: int, run: Callable[[], list], bridges: Sequence[int], items: Sequence[Item]
) -> dict:
    """One path's run: wall seconds, the server's and the callers' (this process and the
    path's bridges) CPU per item (us), items/s, wrong rewards."""
    cpu0 = procs.cpu_mark(server).seconds
    callers0 = _callers_cpu(bridges)
    started = time.perf_counter()
    rewards = run()
    seconds = time.perf_counter() - started
    cpu = procs.cpu_mark(server).seconds - cpu0
    callers_cpu = _callers_cpu(bridges) - callers0
    wrong = scenarios.mismatches(rewards, items)
    return {
        "seconds": round(seconds, 4),
        "server_cpu_us_per_item": round(cpu / len(items) * 1e6, 1),
        "callers_cpu_us_per_item": round(callers_cpu / len(items) * 1e6, 1),
        "items_per_s": round(len(items) / seconds, 1),
        "wrong": wrong,
    }


def _callers_cpu(bridges: Sequence[int]) -> float:
    """CPU seconds of this process (not its children: ng_run is one) and the bridges' trees."""
    own = psutil.Process().cpu_times()
    return own.user + own.system + sum(procs.cpu_mark(pid).seconds for pid in bridges)


Runs = dict[str, tuple[Callable[[], list], tuple[int, ...]]]


def rounds(server: int, runs: Runs, items: Sequence[Item], count: int, log) -> list[dict]:
    """`count` rounds of every path, the order rotated by one each round; per path its
    figures and its ratios to the round's direct run."""
    names = list(runs)
    out = []
    for index in range(count):
        order = names[index % len(names) :] + names[: index % len(names)]
        row = {name: _measure(server, *runs[name], items) for name in order}
        direct = row["direct"]
        for got in row.values():
            got["cpu_vs_direct"] = round(
                got["server_cpu_us_per_item"] / direct["server_cpu_us_per_item"], 3
            )
            got["rate_vs_direct"] = round(got["items_per_s"] / direct["items_per_s"], 3)
        log(f"  round {index + 1}: " + ", ".join(_brief(n, row[n]) for n in names))
        out.append(row)
    return out


def _brief(name: str, got: dict) -> str:
    return f"{name} {got['cpu_vs_direct']:.2f}x cpu {got['rate_vs_direct']:.2f}x rate"


def summary(measured: list[dict]) -> dict:
    """Per path, the medians over rounds of its figures and ratios."""
    keys = ("server_cpu_us_per_item", "callers_cpu_us_per_item", "items_per_s")
    keys += ("cpu_vs_direct", "rate_vs_direct")
    return {
        name: {k: scenarios.median([r[name][k] for r in measured]) for k in keys}
        | {"wrong": sum(r[name]["wrong"] for r in measured)}
        for name in measured[0]
    }


def server_cost(
    version: str | None,
    pinned: bool,
    paths: Sequence[str],
    items_count: int,
    count: int,
    log,
    codes: Sequence[tuple[str, Path]] = (),
) -> dict:
    """Start real mcqa (NeMo Gym `version`) and one bridge per path (and per path and
    (name, checkout) of `codes`), warm each up, run the rounds; the result's "median" holds
    each path's summary."""
    with ExitStack() as stack:
        gym = stack.enter_context(NemoGymServers(("mcqa",), version=version))
        items = clients.make_items(example_rows("mcqa"), items_count)
        verify_url = gym.server_urls["mcqa"] + "/verify"
        server = server_pid(gym, "mcqa")
        runs: Runs = {"direct": (lambda: clients.fanout(verify_url, items, DIRECT_CONCURRENCY), ())}
        pids: list[int] = []
        variants: list[tuple[str, dict[str, str] | None]] = [("", None)]
        variants += [(f"{n}:", {"PYTHONPATH": str(laid_out_elsewhere(c))}) for n, c in codes]
        for path in (p for p in paths if p in DIRECT):
            runs[path] = (lambda c=DIRECT[path]: clients.fanout(verify_url, items, c), ())
        bridge_paths = [p for p in paths if p not in DIRECT]
        for prefix, env, path in ((p, e, path) for p, e in variants for path in bridge_paths):
            name = prefix + path
            bridges, flags = SHARED.get(path, (1, PATHS.get(path, ())))
            started = [
                stack.enter_context(start_bridge("--head-url", gym.head_url, *flags, env=env))
                for _ in range(bridges)
            ]
            pids += [bridge.pid for bridge in started]
            targets = [bridge.target for bridge in started]
            if path in SHARED:
                runs[name] = (lambda ts=targets: shared(ts, items), tuple(b.pid for b in started))
            else:
                runs[name] = (lambda t=targets[0]: clients.reward_fn(t, items), (started[0].pid,))
        if pinned:
            pin(server, SERVER_CPUS)
            os.sched_setaffinity(0, CALLER_CPUS)
            for pid in pids:
                pin(pid, CALLER_CPUS)
        for run, _ in runs.values():  # warm-up: imports, connections, the adaptive limits
            run()
        log(f"scenario 6: NeMo Gym {gym.version}, {'pinned' if pinned else 'unpinned'}")
        measured = rounds(server, runs, items, count, log)
        os.sched_setaffinity(0, SERVER_CPUS | CALLER_CPUS)
        return {
            "nemo_gym": gym.version,
            "pinned": pinned,
            "items": items_count,
            "rounds": measured,
            "median": summary(measured),
        }


def scenario(s, rows: list[dict], log) -> dict:
    """`make bench` scenario 6: both NeMo Gym versions, pinned and unpinned, every path;
    `s.mcqa_items` items per round, `s.mcqa_rounds` rounds (`benchmarks.scenarios.Settings`)."""
    out = {}
    for version in ("0.7.0", "0.4.0"):
        for pinned in (True, False):
            key = f"{version}_{'pinned' if pinned else 'unpinned'}"
            out[key] = server_cost(version, pinned, ALL_PATHS, s.mcqa_items, s.mcqa_rounds, log)
    return out


def markdown_lines(scenario: dict) -> list[str]:
    """Scenario 6's table for the report: per path and setting, the server's CPU per item and
    items/s against the direct fan-out (medians over rounds)."""
    settings = list(scenario)
    lines = [
        "",
        "**6. What each path costs real mcqa** (server CPU per item / items/s, vs direct "
        f"aiohttp fan-out at C = {DIRECT_CONCURRENCY}; medians)",
        "",
    ]
    lines += ["| path | " + " | ".join(settings) + " |", "|---" * (len(settings) + 1) + "|"]
    for path in scenario[settings[0]]["median"]:
        cells = []
        for key in settings:
            got = scenario[key]["median"].get(path)
            cells.append(
                f"{got['cpu_vs_direct']:.2f}x / {got['rate_vs_direct']:.2f}x" if got else ""
            )
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    """The command line of the module docstring; prints the result as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=None, help="NeMo Gym version (default 0.7.0)")
    parser.add_argument("--pinned", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--paths", default=",".join(ALL_PATHS))
    parser.add_argument("--code", action="append", default=[], metavar="NAME=CHECKOUT")
    args = parser.parse_args()
    codes = [(spec.split("=", 1)[0], Path(spec.split("=", 1)[1])) for spec in args.code]
    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in ALL_PATHS]
    if unknown:
        parser.error(f"unknown paths {unknown}; known: {', '.join(ALL_PATHS)}")
    result = server_cost(
        args.version,
        args.pinned,
        paths,
        args.items,
        args.rounds,
        lambda m: print(m, file=sys.stderr, flush=True),
        codes,
    )
    print(json.dumps(result["median"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
