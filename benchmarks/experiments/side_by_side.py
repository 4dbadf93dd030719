"""Two bridges (two interpreters: e.g. main's checkout and this branch) and the direct aiohttp
fan-out against one zero-work upstream, in a rotated order every round: CPU per item,
items/s, and ratios taken within each round (docs/performance.md's method).

    .venv/bin/python -m benchmarks.experiments.side_by_side \\
        --bridge before=../before/.venv/bin/python --bridge after=.venv/bin/python --rounds 5

Each bridge is `<python> -m nemo_gym_grpc.bridge serve --workers 1 --server mcqa=<upstream>`,
started and stopped by PID; its CPU is read with psutil around each run of `--items` items
over `--streams` VerifyStreams. The fan-out runs in this process (stock asyncio, C = 256).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks import clients, procs
from nemo_gym_grpc.shared.child import Child, bridge_command


def start(python: str, upstream: str, env: dict[str, str] | None = None) -> Child:
    """A bridge on a free port, ready, with `env` added to its environment."""
    command = bridge_command("--listen", "127.0.0.1:0", "--workers", "1", python=python)
    child = Child([*command, "--server", f"mcqa={upstream}"], env={**os.environ, **(env or {})})
    child.wait_ready(60)
    return child


def run_bridge(target: str, pid: int, requests_: list, streams: int) -> dict:
    before = procs.cpu_mark(pid).seconds
    run = clients.stream_run(target, requests_, streams=streams)
    cpu = procs.cpu_mark(pid).seconds - before
    if run.failed or run.received != len(requests_):
        raise RuntimeError(f"{target}: {run.failed} failed, {run.received} results")
    return {"cpu_us": cpu / len(requests_) * 1e6, "items_per_s": len(requests_) / run.wall}


def run_direct(verify_url: str, items: list) -> dict:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    clients.fanout(verify_url, items, 256)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"cpu_us": cpu / len(items) * 1e6, "items_per_s": len(items) / wall}


def spread(values: list[float], digits: int = 2) -> str:
    return (
        f"{round(statistics.median(values), digits)} "
        f"({round(min(values), digits)}-{round(max(values), digits)})"
    )


def main() -> int:
    args = command_line().parse_args()
    from tests.support import example_rows

    items = clients.make_items(example_rows("mcqa"), args.items, scripted=True)
    requests_ = clients.grpc_requests(items, "sbs")
    names = [spec.split("=", 1)[0] for spec in args.bridge]
    with procs.Upstream(0.0) as up:
        envs = bridge_envs(names, args.env)
        started = [
            start(spec.split("=", 1)[1], up.url, envs[name])
            for spec, name in zip(args.bridge, names, strict=True)
        ]
        try:
            rounds = run_rounds(up.url, names, started, items, requests_, args)
        finally:
            for child in started:
                child.stop(10)
    print_medians(rounds, names, args)
    if args.out:
        args.out.write_text(json.dumps(rounds, indent=1))
    return 0


def command_line() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bridge", action="append", required=True, help="NAME=PYTHON")
    parser.add_argument(
        "--env", action="append", default=[], help="NAME:KEY=VALUE, for bridge NAME only"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--items", type=int, default=12000)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--out", type=Path, help="write every round as JSON here")
    return parser


def bridge_envs(names: list[str], specs: list[str]) -> dict[str, dict[str, str]]:
    """{bridge name: its added environment} from the NAME:KEY=VALUE `--env` values."""
    envs: dict[str, dict[str, str]] = {name: {} for name in names}
    for spec in specs:
        name, assignment = spec.split(":", 1)
        key, value = assignment.split("=", 1)
        envs[name][key] = value
    return envs


def run_rounds(
    upstream: str,
    names: list[str],
    started: list[Child],
    items: list,
    requests_: list,
    args: argparse.Namespace,
) -> list[dict[str, dict]]:
    """A warm-up, then `args.rounds` rounds of each bridge and the direct fan-out, in an order
    rotated by one each round; one row per round (and a line printed)."""
    rounds: list[dict[str, dict]] = []
    for child in started:  # warm-up
        clients.stream_run(child.address, requests_[:2000], streams=args.streams)
    clients.fanout(upstream + "/verify", items[:2000], 256)
    order = [*names, "direct"]
    for index in range(args.rounds):
        shift = index % len(order)
        row: dict[str, dict] = {}
        for name in order[shift:] + order[:shift]:
            if name == "direct":
                row[name] = run_direct(upstream + "/verify", items)
            else:
                child = started[names.index(name)]
                row[name] = run_bridge(child.address, child.pid, requests_, args.streams)
        row["loadavg"] = {"1min": os.getloadavg()[0]}
        rounds.append(row)
        print(
            f"round {index + 1}: "
            + ", ".join(
                f"{n} {row[n]['cpu_us']:.0f} us/item {row[n]['items_per_s']:.0f}/s" for n in order
            )
            + f", load {row['loadavg']['1min']:.1f}",
            flush=True,
        )
    return rounds


def print_medians(
    rounds: list[dict[str, dict]], names: list[str], args: argparse.Namespace
) -> None:
    """Each bridge's and the fan-out's medians (min-max) over the rounds, with the ratios
    taken within each round (bridge/direct CPU; the first bridge over each other one)."""
    base = names[0]
    print(f"\nmedians (min-max) over {args.rounds} rounds of {args.items} items:")
    for name in [*names, "direct"]:
        cpu = [r[name]["cpu_us"] for r in rounds]
        ips = [r[name]["items_per_s"] for r in rounds]
        line = f"  {name}: CPU/item {spread(cpu, 0)} us, items/s {spread(ips, 0)}"
        if name != "direct":
            over = [r[name]["cpu_us"] / r["direct"]["cpu_us"] for r in rounds]
            line += f", bridge/direct CPU {spread(over)}"
        if name not in (base, "direct"):
            less = [r[base]["cpu_us"] / r[name]["cpu_us"] for r in rounds]
            more = [r[name]["items_per_s"] / r[base]["items_per_s"] for r in rounds]
            line += f", {base}/{name} CPU {spread(less)}, {name}/{base} items/s {spread(more)}"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
