"""`make bench`: the benchmarks of issue 4 in one process tree.

    python -m benchmarks.run [--out benchmarks/results] [--only 1,3] [--rounds 3] [--quick]
    python -m benchmarks.run --scaling 1,2,4,8   # scenario 4 alone, for these --workers

Scenarios: 1 real NeMo Gym mcqa (seed loop vs aiohttp fan-out vs bridge), 2 latency-bound
upstream (20 ms, 500 ms), 3 16,384 items in flight, 4 bridge capacity (--workers 1 and 2,
or the --scaling list; beside it the direct aiohttp fan-out's CPU per request, issue 13's
yardstick), 5 added latency at concurrency 1, 6 what each path costs real mcqa (issue 37:
`benchmarks.server_cost`, both NeMo Gym versions, pinned and unpinned), 7 the adaptive limit
after a latency step 10 ms -> 500 ms -> 10 ms (`benchmarks.latency_step`). Writes results.json,
results.md and one PNG per scenario (1-5) to --out, and prints the markdown. Every server it
starts (ng_run, scripted upstreams, bridges) listens on 127.0.0.1 and is stopped by its
recorded PID.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks import latency_step, procs, report, scale, scenarios, server_cost

SCENARIOS = {
    1: ("1_mcqa", scenarios.real_mcqa),
    2: ("2_latency_bound", scenarios.latency_bound),
    3: ("3_scale", scale.scenario),
    4: ("4_capacity", scenarios.capacity),
    5: ("5_added_latency", scenarios.added_latency),
    6: ("6_server_cost", server_cost.scenario),
    7: ("7_latency_step", latency_step.scenario),
}

QUICK = scenarios.Settings(
    rounds=1,
    mcqa_rounds=1,
    mcqa_items=200,
    latency_items=256,
    latencies=(0.02, 0.5),
    seed_full_max_s=10,
    seed_subset=4,
    scale_items=2048,
    capacity_items=4000,
    probe_items=200,
)


def log(message: str) -> None:
    """Progress on stderr, with the time since start."""
    print(f"[{time.monotonic() - STARTED:6.1f} s] {message}", file=sys.stderr, flush=True)


STARTED = time.monotonic()


def _arguments() -> argparse.Namespace:
    """The command line of the module docstring, parsed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=procs.HERE / "results")
    parser.add_argument("--only", default="1,2,3,4,5,6,7", help="comma-separated scenario numbers")
    parser.add_argument(
        "--rounds", type=int, help="repeats per measurement (default 3; 5 for scenario 1)"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, one round (smoke)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also py-spy the bridge in one extra run of scenarios 3 and 4 (profile_*.txt)",
    )
    parser.add_argument(
        "--scaling",
        help="run scenario 4 (capacity) alone for these comma-separated --workers counts",
    )
    return parser.parse_args()


def main() -> int:
    """Run the chosen scenarios and write the JSON, markdown and plots."""
    args = _arguments()
    settings = QUICK if args.quick else scenarios.Settings()
    if args.scaling:
        settings.workers = tuple(int(x) for x in args.scaling.split(",") if x.strip())
        # SO_REUSEPORT spreads connections, not items: 4+ per worker keeps the shares even.
        settings.capacity_streams = max(settings.capacity_streams, 4 * max(settings.workers))
        args.only = "4"
    if args.rounds:
        settings.rounds = settings.mcqa_rounds = args.rounds
    if args.profile:
        settings.profile_dir = args.out
    chosen = [int(x) for x in args.only.split(",") if x.strip()]
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"  # loopback only

    from tests.support import NEMO_GYM_VERSION, example_rows

    args.out.mkdir(parents=True, exist_ok=True)

    rows = example_rows("mcqa")  # builds the cached NeMo Gym venv on first use
    results = {
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": procs.machine(),
        "versions": procs.versions(NEMO_GYM_VERSION),
        "settings": {k: v for k, v in vars(settings).items() if k != "profile_dir"},
        "load": {"before": procs.loadavg()},
        "scenarios": {},
    }
    log(f"machine {results['machine']}; load {results['load']['before']}")
    for number in chosen:
        key, run = SCENARIOS[number]
        results["scenarios"][key] = run(settings, rows, log)
    results["load"]["after"] = procs.loadavg()
    results["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    results["duration_s"] = round(time.monotonic() - STARTED, 1)
    results["targets"] = report.targets(results)

    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    table = report.markdown(results)
    plots = report.plots(results, args.out)
    table += "\nPlots: " + ", ".join(f"[{p.name}]({p.name})" for p in plots) + "\n"
    (args.out / "results.md").write_text(table)
    print(table)
    log(f"wrote {args.out}/results.json, results.md and {len(plots)} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
