"""Scenarios 1, 2, 4 and 5 of issue 4 (3 is benchmarks/scale.py). Each returns a JSON-ready
dict with its per-round numbers and their medians; ratios are taken within a round (the paths
run back to back), then the median over rounds is reported."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks import clients, procs
from benchmarks.clients import Item
from tests.support import BridgeProcess, NemoGymServers, start_bridge

Log = Callable[[str], None]


@dataclass
class Settings:
    """Sizes and repeats (the defaults are issue 4's; `--quick` shrinks them)."""

    rounds: int = 3
    mcqa_rounds: int = 5  # scenario 1 (a real NeMo Gym server sharing the cores) is noisiest
    concurrency: int = 256  # (b)'s C and the bridge's --max-in-flight (its adaptive ceiling)
    mcqa_items: int = 1000
    latency_items: int = 1024
    latencies: tuple[float, ...] = (0.02, 0.5)
    seed_full_max_s: float = 40.0  # longer seed loops are timed on `seed_subset` items
    seed_subset: int = 16
    scale_items: int = 16384
    scale_latency: float = 1.0
    capacity_items: int = 20000
    capacity_streams: int = 16  # connections; SO_REUSEPORT spreads connections, not items
    workers: tuple[int, ...] = (1, 2)
    probe_items: int = 1000
    profile_dir: Path | None = None  # set: py-spy profiles of an extra run of scenarios 3, 4


def median(values: Sequence[float]) -> float:
    """The median, rounded to 6 digits."""
    return round(statistics.median(values), 6)


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def timed(fn: Callable[[], list]) -> tuple[float, list]:
    """(seconds `fn()` took, what it returned)."""
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def mismatches(rewards: Sequence[float | None], items: Sequence[Item]) -> int:
    """How many of `rewards` differ from their item's expected reward."""
    return sum(r != it.expected for r, it in zip(rewards, items, strict=True))


def _three_ways(
    verify_url: str,
    bridge: BridgeProcess,
    items: list[Item],
    s: Settings,
    seed_items: int,
    log: Log,
    round_count: int,
) -> list[dict]:
    """Rounds of (a) seed loop, (b) fan-out, (c) reward function through the bridge; (b) and
    (c) swap places every other round, so neither always runs on an upstream just warmed or
    just loaded by the other."""
    clients.seed_loop(verify_url, items[:8])  # warm-up (imports, first connections)
    clients.fanout(verify_url, items[: s.concurrency], s.concurrency)
    clients.reward_fn(bridge.target, items[: s.concurrency])
    rounds = []
    for index in range(round_count):
        seed_s, seed_out = timed(lambda: clients.seed_loop(verify_url, items[:seed_items]))
        if index % 2:
            cpu0 = procs.cpu_mark(bridge.pid).seconds
            bridge_s, bridge_out = timed(lambda: clients.reward_fn(bridge.target, items))
            bridge_cpu = procs.cpu_mark(bridge.pid).seconds - cpu0
        fan_s, fan_out = timed(lambda: clients.fanout(verify_url, items, s.concurrency))
        if not index % 2:
            cpu0 = procs.cpu_mark(bridge.pid).seconds
            bridge_s, bridge_out = timed(lambda: clients.reward_fn(bridge.target, items))
            bridge_cpu = procs.cpu_mark(bridge.pid).seconds - cpu0
        row = {
            "seed_s": round(seed_s * len(items) / seed_items, 4),
            "seed_measured_items": seed_items,
            "fanout_s": round(fan_s, 4),
            "bridge_s": round(bridge_s, 4),
            "bridge_cpu_us_per_item": round(bridge_cpu / len(items) * 1e6, 1),
            "bridge_failed": sum(r is None for r in bridge_out),
            "wrong_rewards": {
                "seed": mismatches(seed_out, items[:seed_items]),
                "fanout": mismatches(fan_out, items),
                "bridge": mismatches(bridge_out, items),
            },
        }
        row["c_over_b"] = round(row["fanout_s"] / row["bridge_s"], 4)
        row["c_over_a"] = round(row["seed_s"] / row["bridge_s"], 2)
        log(
            f"  round {index + 1}: seed {row['seed_s']:.2f} s"
            f"{'' if seed_items == len(items) else f' (from {seed_items} items)'}, "
            f"fan-out {fan_s:.3f} s, bridge {bridge_s:.3f} s; (c)/(b) {row['c_over_b']:.3f}, "
            f"(c)/(a) {row['c_over_a']:.1f}x"
        )
        rounds.append(row)
    return rounds


def _summary(rounds: list[dict], count: int) -> dict:
    out = {
        key: median([r[key] for r in rounds])
        for key in (
            "seed_s",
            "fanout_s",
            "bridge_s",
            "c_over_b",
            "c_over_a",
            "bridge_cpu_us_per_item",
        )
    }
    for key in ("seed", "fanout", "bridge"):
        out[f"{key}_items_per_s"] = round(count / out[f"{key}_s"], 1)
    return out


def real_mcqa(s: Settings, rows: list[dict], log: Log) -> dict:
    """Scenario 1: a real NeMo Gym mcqa server (ng_run), N items, the three ways."""
    items = clients.make_items(rows, s.mcqa_items)
    log("scenario 1: real NeMo Gym mcqa (starting ng_run ...)")
    with NemoGymServers(("mcqa",)) as gym:
        log(f"  ng_run ready in {gym.startup_seconds} s")
        verify_url = gym.server_urls["mcqa"] + "/verify"
        with start_bridge("--head-url", gym.head_url, "--max-in-flight", str(s.concurrency)) as b:
            rounds = _three_ways(verify_url, b, items, s, len(items), log, s.mcqa_rounds)
    return {
        "items": len(items),
        "concurrency": s.concurrency,
        "rounds": rounds,
        "median": _summary(rounds, len(items)),
    }


def latency_bound(s: Settings, rows: list[dict], log: Log) -> dict:
    """Scenario 2: a scripted upstream answering after L seconds, N items, the three ways.
    A seed loop longer than `seed_full_max_s` is timed on `seed_subset` items and scaled."""
    items = clients.make_items(rows, s.latency_items, scripted=True)
    out = {}
    for latency in s.latencies:
        full = latency * len(items) <= s.seed_full_max_s
        seed_items = len(items) if full else s.seed_subset
        log(f"scenario 2: upstream latency {latency * 1000:.0f} ms, {len(items)} items")
        with procs.Upstream(latency) as up:
            args = ("--server", f"mcqa={up.url}", "--max-in-flight", str(s.concurrency))
            with start_bridge(*args) as bridge:
                rounds = _three_ways(
                    up.url + "/verify", bridge, items, s, seed_items, log, s.rounds
                )
        out[f"{latency * 1000:.0f}ms"] = {
            "latency_s": latency,
            "items": len(items),
            "concurrency": s.concurrency,
            "seed_extrapolated_from": None if full else seed_items,
            "rounds": rounds,
            "median": _summary(rounds, len(items)),
        }
    return out


def _capacity_round(
    target: str, bridge_pid: int, upstream_pid: int, requests_: list, streams: int
) -> dict:
    """One measured capacity run: throughput and CPU per item of bridge, upstream, client."""
    bridge0, up0 = procs.cpu_mark(bridge_pid), procs.cpu_mark(upstream_pid).seconds
    client0 = time.process_time()
    run = clients.stream_run(target, requests_, streams=streams)
    client_s = time.process_time() - client0
    bridge1, up_s = procs.cpu_mark(bridge_pid), procs.cpu_mark(upstream_pid).seconds - up0
    by_process = [bridge1.per_pid[p] - bridge0.per_pid.get(p, 0.0) for p in bridge1.per_pid]
    n = len(requests_)
    return {
        "wall_s": round(run.wall, 4),
        "items_per_s": round(n / run.wall, 1),
        "bridge_cpu_us_per_item": round((bridge1.seconds - bridge0.seconds) / n * 1e6, 1),
        "bridge_cpu_s_by_process": sorted(round(x, 3) for x in by_process),
        "upstream_cpu_us_per_item": round(up_s / n * 1e6, 1),
        "client_cpu_us_per_item": round(client_s / n * 1e6, 1),
        "failed": run.failed,
    }


def _direct_cpu_us(verify_url: str, items: list[Item], concurrency: int) -> float:
    """CPU microseconds per request of (b), the direct aiohttp fan-out (stock asyncio, this
    process, the same items and upstream as the bridge): the yardstick of goal 1."""
    cpu0 = time.process_time()
    rewards = clients.fanout(verify_url, items, concurrency)
    cpu = time.process_time() - cpu0
    if wrong := mismatches(rewards, items):
        raise RuntimeError(f"direct fan-out: {wrong} wrong rewards")
    return round(cpu / len(items) * 1e6, 1)


def capacity(s: Settings, rows: list[dict], log: Log) -> dict:
    """Scenario 4: bridge throughput and CPU per item against a zero-latency upstream, with
    `serve --workers W` for each W, over `capacity_streams` connections; beside each round,
    the direct aiohttp fan-out's CPU per request on the same upstream and items (the two
    swap order every other round), and the bridge's CPU per item over it."""
    items = clients.make_items(rows, s.capacity_items, scripted=True)
    requests_ = clients.grpc_requests(items, "cap")
    out = {}
    for workers in s.workers:
        log(f"scenario 4: capacity, --workers {workers}, {len(items)} items")
        rounds = []
        with procs.Upstream(0.0) as up:
            args = ("--server", f"mcqa={up.url}", "--workers", str(workers))
            with start_bridge(*args) as bridge:
                clients.stream_run(bridge.target, requests_[:2000], streams=s.capacity_streams)
                verify_url = up.url + "/verify"
                clients.fanout(verify_url, items[:2000], s.concurrency)  # warm-up
                for index in range(s.rounds):
                    if index % 2:
                        direct = _direct_cpu_us(verify_url, items, s.concurrency)
                    row = _capacity_round(
                        bridge.target, bridge.pid, up.pid, requests_, s.capacity_streams
                    )
                    if not index % 2:
                        direct = _direct_cpu_us(verify_url, items, s.concurrency)
                    row["direct_cpu_us_per_request"] = direct
                    row["bridge_over_direct_cpu"] = round(row["bridge_cpu_us_per_item"] / direct, 3)
                    log(
                        f"  round {index + 1}: {row['items_per_s']:.0f} items/s, bridge "
                        f"{row['bridge_cpu_us_per_item']:.0f} us CPU/item (by process "
                        f"{row['bridge_cpu_s_by_process']} s), upstream "
                        f"{row['upstream_cpu_us_per_item']:.0f} us, client "
                        f"{row['client_cpu_us_per_item']:.0f} us, {row['failed']} failed; "
                        f"direct fan-out {direct:.0f} us CPU/request, bridge/direct "
                        f"{row['bridge_over_direct_cpu']:.2f}"
                    )
                    rounds.append(row)
                if s.profile_dir:
                    profile = s.profile_dir / f"profile_capacity_w{workers}.txt"
                    with procs.profiled(bridge.pid, profile):
                        clients.stream_run(bridge.target, requests_, streams=s.capacity_streams)
        keys = (
            "items_per_s",
            "bridge_cpu_us_per_item",
            "upstream_cpu_us_per_item",
            "client_cpu_us_per_item",
            "direct_cpu_us_per_request",
            "bridge_over_direct_cpu",
        )
        ratios = [r["bridge_over_direct_cpu"] for r in rounds]
        out[f"workers_{workers}"] = {
            "workers": workers,
            "items": len(items),
            "streams": s.capacity_streams,
            "rounds": rounds,
            "median": {key: median([r[key] for r in rounds]) for key in keys},
            "bridge_over_direct_cpu_range": [min(ratios), max(ratios)],
        }
    return out


def _percentiles(values: Sequence[float]) -> list[float]:
    """Milliseconds at the 0th, 1st, ..., 100th percentile (for CDF plots)."""
    return [round(quantile(values, q / 100) * 1000, 4) for q in range(101)]


def added_latency(s: Settings, rows: list[dict], log: Log) -> dict:
    """Scenario 5: per-item latency at concurrency 1 against a zero-latency upstream:
    direct HTTP, unary Verify through the bridge, one-item VerifyStream (the reward
    functions' client) through the bridge; and the same two gRPC clients against a no-op
    grpc.aio servicer (`floor.py`: gRPC's own round trip, the floor under what the bridge
    adds)."""
    item = clients.make_items(rows, 1, scripted=True)[0]
    request = clients.grpc_requests([item], "probe")[0]
    count = s.probe_items
    log(f"scenario 5: added latency at concurrency 1, {count} calls per path")
    rounds = []
    with procs.Upstream(0.0) as up, procs.Floor() as floor:
        with start_bridge("--server", f"mcqa={up.url}") as bridge:
            url = up.url + "/verify"
            paths = {
                "direct": lambda: clients.direct_latencies(url, item, count),
                "unary": lambda: clients.unary_latencies(bridge.target, request, count),
                "stream1": lambda: clients.stream1_latencies(bridge.target, request, count),
                "floor_unary": lambda: clients.unary_latencies(floor.address, request, count),
                "floor_stream1": lambda: clients.stream1_latencies(floor.address, request, count),
            }
            for path in paths.values():
                path()  # warm-up
            for index in range(s.rounds):
                samples = {name: path() for name, path in paths.items()}
                row = {}
                for name, values in samples.items():
                    row[f"{name}_p50_ms"] = round(quantile(values, 0.5) * 1000, 4)
                    row[f"{name}_p99_ms"] = round(quantile(values, 0.99) * 1000, 4)
                    row[f"{name}_percentiles_ms"] = _percentiles(values)
                for name in ("unary", "stream1"):
                    for p in ("p50", "p99"):
                        row[f"{name}_added_{p}_ms"] = round(
                            row[f"{name}_{p}_ms"] - row[f"direct_{p}_ms"], 4
                        )
                    # What the bridge adds beyond gRPC's own round trip and the HTTP call.
                    row[f"{name}_over_floor_p50_ms"] = round(
                        row[f"{name}_added_p50_ms"] - row[f"floor_{name}_p50_ms"], 4
                    )
                log(
                    f"  round {index + 1}: p50 direct {row['direct_p50_ms']:.3f} ms, unary "
                    f"{row['unary_p50_ms']:.3f} ms (+{row['unary_added_p50_ms']:.3f}), "
                    f"stream {row['stream1_p50_ms']:.3f} ms (+{row['stream1_added_p50_ms']:.3f}); "
                    f"no-op servicer: unary {row['floor_unary_p50_ms']:.3f}, stream "
                    f"{row['floor_stream1_p50_ms']:.3f} ms; p99 direct {row['direct_p99_ms']:.3f}, "
                    f"unary {row['unary_p99_ms']:.3f}, stream {row['stream1_p99_ms']:.3f} ms"
                )
                rounds.append(row)
    keys = [k for k in rounds[0] if not k.endswith("percentiles_ms")]
    return {
        "calls_per_path": count,
        "rounds": rounds,
        "median": {key: median([r[key] for r in rounds]) for key in keys},
    }
