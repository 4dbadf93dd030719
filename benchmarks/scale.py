"""Scenario 3 (issues 4 and 37): `scale_items` items (16,384) in flight at once on VerifyStreams
against an upstream with `scale_latency` s (1 s) latency, through a bridge with its defaults,
beside the direct aiohttp fan-out of the same items and a bridge with the limit off.

Each round starts a fresh upstream and bridge and sends the items twice: once to the new
bridge (`cold`: its adaptive limit starts at 20 calls and grows by 8 per round trip of
answers, `bridge.flows.limits`, so it is four round trips before all are in flight), and again
WARM_PAUSE s after the last result (`warm`: the limit and the upstream connections it found;
what every later batch of a training run meets, as scenario 6 measures its bridges after a
warm-up). A second fresh upstream and bridge, started with `--fixed-concurrency` as many as
the items (the limit off: every item in flight at once), take the same two batches: what these
cores allow with no limit to grow. The order of the three swaps each round.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks import clients, procs
from benchmarks.clients import Item
from benchmarks.scenarios import Log, Settings, median, timed
from nemo_gym_grpc.bridge.process.config import BridgeConfig
from tests.support import start_bridge

# Seconds between the cold and the warm batch (a training step's gap, at its shortest).
WARM_PAUSE = 2.0
# The figures each round reports per batch (the warm batch's prefixed "warm_"), and their
# medians; the peak RSS after the warm batch is the higher of the two batches'.
KEYS = ("wall_s", "first_result_s", "bridge_cpu_s", "peak_rss_mb")
# The two batches' seconds with the limit off.
LIMIT_OFF = ("limit_off_wall_s", "limit_off_warm_wall_s")


def _downsample(timeline: list[tuple[float, int]], points: int = 200) -> list[list[float]]:
    step = max(1, len(timeline) // points)
    kept = timeline[::step] + ([timeline[-1]] if timeline else [])
    return [[round(t, 4), n] for t, n in kept]


def _batch(target: str, pid: int, requests_: list, streams: int, prefix: str) -> dict[str, Any]:
    """All of `requests_` at once over `streams` VerifyStreams to the bridge at `target`."""
    cpu0 = procs.cpu_mark(pid).seconds
    run = clients.stream_run(target, requests_, streams=streams)
    return {
        f"{prefix}wall_s": round(run.wall, 4),
        f"{prefix}first_result_s": round(run.first, 4),
        f"{prefix}bridge_cpu_s": round(procs.cpu_mark(pid).seconds - cpu0, 3),
        f"{prefix}received": run.received,
        f"{prefix}failed": run.failed,
        f"{prefix}timeline": _downsample(run.timeline),
    }


def _round(
    requests_: list, latency: float, profile: Path | None = None, flags: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A cold and a warm batch (module docstring) with a fresh upstream and bridge (given
    `flags` too), over as many VerifyStreams as the bridge's `--max-stream-items` (4,096)
    takes; `profile`: py-spy the cold batch's bridge into that file."""
    streams = -(-len(requests_) // BridgeConfig().max_stream_items)
    with procs.Upstream(latency) as up:
        command = ("--server", f"mcqa={up.url}", "--verify-timeout", "60", *flags)
        with start_bridge(*command) as bridge:
            idle_rss = procs.peak_rss_mb(bridge.pid)
            if profile:
                with procs.profiled(bridge.pid, profile):
                    return _batch(bridge.target, bridge.pid, requests_, streams, "")
            row = _batch(bridge.target, bridge.pid, requests_, streams, "")
            row["peak_rss_mb"] = round(procs.peak_rss_mb(bridge.pid), 1)
            time.sleep(WARM_PAUSE)
            row |= _batch(bridge.target, bridge.pid, requests_, streams, "warm_")
            row["warm_peak_rss_mb"] = round(procs.peak_rss_mb(bridge.pid), 1)  # both batches'
            row["idle_rss_mb"] = round(idle_rss, 1)
            return row


def _direct_s(items: list[Item], latency: float) -> float:
    """Seconds for the direct aiohttp fan-out to POST all of `items` at once (concurrency =
    len(items)) to a fresh upstream: the yardstick beside the bridge's time."""
    with procs.Upstream(latency) as up:
        seconds, _ = timed(lambda: clients.fanout(f"{up.url}/verify", items, len(items)))
    return round(seconds, 4)


def scenario(s: Settings, rows: list[dict], log: Log) -> dict[str, Any]:
    """Scenario 3 (module docstring): `s.rounds` rounds; per round the cold and warm batch
    figures, the bridge's peak RSS, the same batches' seconds with the limit off and the direct
    fan-out's seconds, and their medians."""
    items = clients.make_items(rows, s.scale_items, scripted=True)
    requests_ = clients.grpc_requests(items, "scale")
    log(f"scenario 3: {len(items)} items in flight, upstream latency {s.scale_latency} s")
    off = ("--fixed-concurrency", str(len(requests_)))
    runs = {
        "bridge": lambda: _round(requests_, s.scale_latency),
        "limit_off": lambda: _round(requests_, s.scale_latency, flags=off),
        "direct": lambda: _direct_s(items, s.scale_latency),
    }
    rounds = []
    for index in range(s.rounds):
        order = reversed(runs) if index % 2 else iter(runs)
        got = {name: runs[name]() for name in order}
        row, direct_s = got["bridge"], got["direct"]
        row["direct_wall_s"] = direct_s
        row["limit_off_wall_s"] = got["limit_off"]["wall_s"]
        row["limit_off_warm_wall_s"] = got["limit_off"]["warm_wall_s"]
        log(
            f"  round {index + 1}: done in {row['wall_s']:.2f} s cold, {row['warm_wall_s']:.2f} s "
            f"warm (limit off {row['limit_off_wall_s']:.2f} s and "
            f"{row['limit_off_warm_wall_s']:.2f} s; direct fan-out {direct_s:.2f} s), "
            f"first result {row['first_result_s']:.2f} "
            f"s, peak RSS {row['peak_rss_mb']:.0f} MiB cold, {row['warm_peak_rss_mb']:.0f} MiB "
            f"warm, bridge CPU {row['bridge_cpu_s']:.2f} s cold, "
            f"{row['warm_bridge_cpu_s']:.2f} s warm, {row['failed']} + "
            f"{row['warm_failed']} failed"
        )
        rounds.append(row)
    if s.profile_dir:
        _round(requests_, s.scale_latency, s.profile_dir / "profile_scale.txt")
    keys = (*KEYS, *(f"warm_{k}" for k in KEYS), "direct_wall_s", *LIMIT_OFF)
    return {
        "items": len(items),
        "upstream_latency_s": s.scale_latency,
        "warm_pause_s": WARM_PAUSE,
        "rounds": rounds,
        "median": {key: median([r[key] for r in rounds]) for key in keys},
    }
