"""Targets of issue 4 checked against a results dict; the markdown table and the PNG plots."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks import latency_step, server_cost  # noqa: E402

RSS_GOAL_MIB = 300 * 1e6 / 2**20  # issue 13's 300 MB, in the MiB the RSS is read in

# Issue 4's targets, one row each: name, target text, path to the measured value under
# results["scenarios"] (None: the best capacity over the --workers counts), bound, whether the
# value must be at least (True) or at most (False) the bound, unit shown after the value.
TARGETS = (
    ("(c)/(b) on real mcqa", ">= 1.0", ("1_mcqa", "median", "c_over_b"), 1.0, True, ""),
    (
        "(c)/(b), L = 20 ms, N = 1,024",
        ">= 1.0",
        ("2_latency_bound", "20ms", "median", "c_over_b"),
        1.0,
        True,
        "",
    ),
    (
        "speed-up over the seed loop, L = 20 ms, N = 1,024",
        ">= 40x",
        ("2_latency_bound", "20ms", "median", "c_over_a"),
        40,
        True,
        "x",
    ),
    (
        "16,384 in flight: done, a new bridge (its limit grows from 20)",
        "<= 3 s",
        ("3_scale", "median", "wall_s"),
        3,
        False,
        " s",
    ),
    (
        "16,384 in flight: done, the bridge's next batch (limit and connections found)",
        "<= 3 s",
        ("3_scale", "median", "warm_wall_s"),
        3,
        False,
        " s",
    ),
    (
        "16,384 in flight: first result",
        "<= 1.2 s",
        ("3_scale", "median", "first_result_s"),
        1.2,
        False,
        " s",
    ),
    (
        "16,384 in flight: bridge peak RSS, a new bridge",
        "<= 300 MB",
        ("3_scale", "median", "peak_rss_mb"),
        RSS_GOAL_MIB,
        False,
        " MiB",
    ),
    (
        "16,384 in flight: bridge peak RSS, after its next batch",
        "<= 300 MB",
        ("3_scale", "median", "warm_peak_rss_mb"),
        RSS_GOAL_MIB,
        False,
        " MiB",
    ),
    ("bridge capacity (best --workers count)", ">= 5,000 items/s", None, 5000, True, "/s"),
    (
        "bridge CPU per item / direct aiohttp fan-out CPU per request, --workers 1",
        "<= 0.75",
        ("4_capacity", "workers_1", "median", "bridge_over_direct_cpu"),
        0.75,
        False,
        "",
    ),
    (
        "added p50 latency, unary Verify",
        "<= 0.5 ms",
        ("5_added_latency", "median", "unary_added_p50_ms"),
        0.5,
        False,
        " ms",
    ),
    (
        "added p50 latency, 1-item VerifyStream (reward fn client)",
        "<= 1 ms",
        ("5_added_latency", "median", "stream1_added_p50_ms"),
        1.0,
        False,
        " ms",
    ),
)

# Scenario 1 and 2's three contenders, in the plots.
LABELS = ["(a) seed loop", "(b) aiohttp fan-out", "(c) bridge"]
COLORS = ["#999999", "#4c72b0", "#dd8452"]


def _get(results: dict, *path: str) -> float | None:
    node = results.get("scenarios", {})
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def targets(results: dict) -> list[dict]:
    """One row per target: name, target text, measured value (or None if not run), met."""
    capacity = [e["median"]["items_per_s"] for e in (_get(results, "4_capacity") or {}).values()]
    best_capacity = max((c for c in capacity if c is not None), default=None)
    out = []
    for name, text, path, bound, at_least, unit in TARGETS:
        value = best_capacity if path is None else _get(results, *path)
        met = None if value is None else (value >= bound if at_least else value <= bound)
        out.append({"target": name, "want": text, "measured": value, "unit": unit, "met": met})
    return out


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "not run"
    digits = 3 if abs(value) < 10 else 1 if abs(value) < 1000 else 0
    return f"{value:,.{digits}f}{unit}"


def _header(results: dict) -> list[str]:
    """The machine, load and versions line, and the targets table."""
    m, v = results["machine"], results["versions"]
    lines = [
        "# nemo-gym-grpc benchmark results",
        "",
        f"{results['finished_at']}; {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB; "
        f"load average {results['load']['before'][0]} before, {results['load']['after'][0]} "
        f"after; medians of {results['settings']['rounds']} rounds "
        f"({results['settings']['mcqa_rounds']} for scenario 1).",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val) + ".",
        "",
        "| target | wanted | measured | met |",
        "|---|---|---|---|",
    ]
    for row in results["targets"]:
        met = {True: "yes", False: "**no**", None: "-"}[row["met"]]
        lines.append(
            f"| {row['target']} | {row['want']} | {_fmt(row['measured'], row['unit'])} | {met} |"
        )
    return lines


def _mcqa_text(scenario: dict) -> list[str]:
    d = scenario["median"]
    return [
        "",
        f"**1. Real NeMo Gym mcqa**, N = {scenario['items']}, C = "
        f"{scenario['concurrency']}: (a) seed loop {_fmt(d['seed_items_per_s'])}/s, "
        f"(b) aiohttp fan-out {_fmt(d['fanout_items_per_s'])}/s, (c) bridge "
        f"{_fmt(d['bridge_items_per_s'])}/s; (c)/(b) {_fmt(d['c_over_b'])}, (c)/(a) "
        f"{_fmt(d['c_over_a'])}x; bridge CPU {_fmt(d['bridge_cpu_us_per_item'], ' us')} "
        "per item.",
    ]


def _latency_bound_text(scenario: dict) -> list[str]:
    lines = ["", "**2. Latency-bound upstream**, wall time for N items:", ""]
    lines += ["| L | N | (a) seed | (b) fan-out | (c) bridge | (c)/(b) | (c) vs (a) |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for key, entry in scenario.items():
        d = entry["median"]
        extrapolated = entry["seed_extrapolated_from"]
        note = f" (from {extrapolated} items)" if extrapolated else ""
        lines.append(
            f"| {key} | {entry['items']} | {_fmt(d['seed_s'], ' s')}{note} | "
            f"{_fmt(d['fanout_s'], ' s')} | {_fmt(d['bridge_s'], ' s')} | "
            f"{_fmt(d['c_over_b'])} | {_fmt(d['c_over_a'])}x |"
        )
    return lines


def _scale_text(scenario: dict) -> list[str]:
    d = scenario["median"]
    return [
        "",
        f"**3. Scale**: {scenario['items']} items in flight, upstream latency "
        f"{scenario['upstream_latency_s']} s: done in {_fmt(d['wall_s'], ' s')} by a new "
        f"bridge and in {_fmt(d.get('warm_wall_s'), ' s')} by the same bridge "
        f"{scenario.get('warm_pause_s', 0):g} s later (with the limit off, `--fixed-concurrency "
        f"{scenario['items']}`: {_fmt(d.get('limit_off_wall_s'), ' s')} and "
        f"{_fmt(d.get('limit_off_warm_wall_s'), ' s')}; the direct aiohttp fan-out of the same "
        f"items: {_fmt(d.get('direct_wall_s'), ' s')}), first result "
        f"{_fmt(d['first_result_s'], ' s')}, bridge peak RSS {_fmt(d['peak_rss_mb'], ' MiB')} "
        f"and {_fmt(d.get('warm_peak_rss_mb'), ' MiB')}, bridge CPU "
        f"{_fmt(d['bridge_cpu_s'], ' s')} and {_fmt(d.get('warm_bridge_cpu_s'), ' s')}.",
    ]


def _capacity_text(scenario: dict) -> list[str]:
    lines = ["", "**4. Capacity** (zero-work upstream; all processes share the cores):", ""]
    lines += [
        "| workers | items/s | bridge CPU/item | upstream CPU/item | client CPU/item "
        "| direct fan-out CPU/request | bridge / direct (min-max) "
        "| bridge CPU s by process, per round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in scenario.values():
        d = entry["median"]
        low, high = entry["bridge_over_direct_cpu_range"]
        split = "; ".join(
            " + ".join(f"{x:.2f}" for x in r["bridge_cpu_s_by_process"]) for r in entry["rounds"]
        )
        lines.append(
            f"| {entry['workers']} | {_fmt(d['items_per_s'])} | "
            f"{_fmt(d['bridge_cpu_us_per_item'], ' us')} | "
            f"{_fmt(d['upstream_cpu_us_per_item'], ' us')} | "
            f"{_fmt(d['client_cpu_us_per_item'], ' us')} | "
            f"{_fmt(d['direct_cpu_us_per_request'], ' us')} | "
            f"{_fmt(d['bridge_over_direct_cpu'])} ({low:.2f}-{high:.2f}) | {split} |"
        )
    return lines


def _added_latency_text(scenario: dict) -> list[str]:
    d = scenario["median"]
    return [
        "",
        "**5. Added latency** at concurrency 1 (zero-work upstream), p50 / p99: direct HTTP "
        f"{_fmt(d['direct_p50_ms'])} / {_fmt(d['direct_p99_ms'], ' ms')}; unary Verify "
        f"{_fmt(d['unary_p50_ms'])} / {_fmt(d['unary_p99_ms'], ' ms')}; 1-item VerifyStream "
        f"{_fmt(d['stream1_p50_ms'])} / {_fmt(d['stream1_p99_ms'], ' ms')}."
        + (
            " The same clients against a no-op grpc.aio servicer (gRPC's own round trip, "
            f"p50): unary {_fmt(d['floor_unary_p50_ms'])}, 1-item VerifyStream "
            f"{_fmt(d['floor_stream1_p50_ms'], ' ms')}; the bridge's p50 beyond that floor "
            f"and the HTTP call: unary {_fmt(d['unary_over_floor_p50_ms'])}, stream "
            f"{_fmt(d['stream1_over_floor_p50_ms'], ' ms')}."
            if "floor_unary_p50_ms" in d
            else ""
        ),
    ]


# Each scenario's paragraph or table in the markdown, in report order.
TEXTS: dict[str, Callable[[dict], list[str]]] = {
    "1_mcqa": _mcqa_text,
    "2_latency_bound": _latency_bound_text,
    "3_scale": _scale_text,
    "4_capacity": _capacity_text,
    "5_added_latency": _added_latency_text,
    "6_server_cost": server_cost.markdown_lines,
    "7_latency_step": latency_step.markdown_lines,
}


def markdown(results: dict) -> str:
    """The short markdown report: machine, targets table, per-scenario medians."""
    lines = _header(results)
    for key, text in TEXTS.items():
        if key in results["scenarios"]:
            lines += text(results["scenarios"][key])
    return "\n".join(lines) + "\n"


def _mcqa_plot(scenario: dict) -> plt.Figure:
    d = scenario["median"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    values = [d["seed_items_per_s"], d["fanout_items_per_s"], d["bridge_items_per_s"]]
    ax.bar(LABELS, values, color=COLORS)
    for i, value in enumerate(values):
        ax.text(i, value, f"{value:,.0f}", ha="center", va="bottom")
    ax.set_ylabel("items/s")
    ax.set_title(f"1. Real NeMo Gym mcqa, N = {scenario['items']}")
    return fig


def _latency_bound_plot(scenario: dict) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.27
    for j, key in enumerate(("seed_s", "fanout_s", "bridge_s")):
        xs = [i + (j - 1) * width for i in range(len(scenario))]
        ys = [e["median"][key] for e in scenario.values()]
        ax.bar(xs, ys, width, label=LABELS[j], color=COLORS[j])
        for x, y in zip(xs, ys, strict=True):
            ax.text(x, y, f"{y:.3g}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(scenario)), [f"L = {k}" for k in scenario])
    ax.set_yscale("log")
    ax.set_ylabel("wall time, s (log)")
    ax.set_title("2. Latency-bound upstream, N = 1,024")
    ax.legend(fontsize=8)
    return fig


def _scale_plot(scenario: dict) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, r in enumerate(scenario["rounds"]):
        ts, ns = zip(*r["timeline"], strict=True) if r["timeline"] else ((), ())
        ax.plot(ts, ns, color=f"C{i}", label=f"round {i + 1}, new bridge")
        if r.get("warm_timeline"):
            ts, ns = zip(*r["warm_timeline"], strict=True)
            ax.plot(ts, ns, color=f"C{i}", ls="--", label=f"round {i + 1}, next batch")
    ax.axvline(3.0, color="black", ls="--", lw=1, label="target: done <= 3 s")
    ax.axvline(1.2, color="grey", ls=":", lw=1, label="target: first <= 1.2 s")
    ax.set_xlabel("seconds since the first item was sent")
    ax.set_ylabel("results received")
    ax.set_title(f"3. {scenario['items']:,} items in flight, 1 s upstream")
    ax.legend(fontsize=8)
    return fig


def _capacity_plot(scenario: dict) -> plt.Figure:
    """Items/s per --workers count beside CPU per item, stacked: bridge, upstream, client."""
    entries = list(scenario.values())
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3.5))
    names = [f"--workers {e['workers']}" for e in entries]
    ax1.bar(names, [e["median"]["items_per_s"] for e in entries], color="#dd8452")
    ax1.axhline(5000, color="red", ls="--", lw=1, label="target 5,000/s")
    ax1.set_ylabel("items/s")
    ax1.legend(fontsize=8)
    for key, color in (
        ("bridge_cpu_us_per_item", "#dd8452"),
        ("upstream_cpu_us_per_item", "#55a868"),
        ("client_cpu_us_per_item", "#4c72b0"),
    ):
        bottoms = [0.0] * len(entries)
        if key != "bridge_cpu_us_per_item":
            bottoms = [e["median"]["bridge_cpu_us_per_item"] for e in entries]
            if key == "client_cpu_us_per_item":
                bottoms = [
                    b + e["median"]["upstream_cpu_us_per_item"]
                    for b, e in zip(bottoms, entries, strict=True)
                ]
        ax2.bar(
            names,
            [e["median"][key] for e in entries],
            bottom=bottoms,
            color=color,
            label=key.split("_")[0],
        )
    ax2.set_ylabel("CPU us per item")
    ax2.legend(fontsize=8)
    fig.suptitle("4. Capacity against a zero-work upstream")
    return fig


def _added_latency_plot(scenario: dict) -> plt.Figure:
    """The latency percentiles of the round with the median unary added p50."""
    rounds = scenario["rounds"]
    middle = sorted(rounds, key=lambda r: r["unary_added_p50_ms"])[len(rounds) // 2]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, label in (
        ("direct", "direct HTTP"),
        ("unary", "bridge, unary Verify"),
        ("stream1", "bridge, 1-item VerifyStream"),
        ("floor_unary", "no-op servicer, unary"),
        ("floor_stream1", "no-op servicer, 1-item VerifyStream"),
    ):
        if f"{name}_percentiles_ms" not in middle:
            continue
        ax.plot(middle[f"{name}_percentiles_ms"], range(101), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("latency per item, ms (log)")
    ax.set_ylabel("percentile")
    ax.set_title("5. Latency at concurrency 1 (zero-work upstream)")
    ax.legend(fontsize=8)
    return fig


# Each scenario's figure, written as <scenario key>.png, in report order.
PLOTS: dict[str, Callable[[dict], plt.Figure]] = {
    "1_mcqa": _mcqa_plot,
    "2_latency_bound": _latency_bound_plot,
    "3_scale": _scale_plot,
    "4_capacity": _capacity_plot,
    "5_added_latency": _added_latency_plot,
}


def plots(results: dict, out: Path) -> list[Path]:
    """Write one PNG per scenario that ran (out/<scenario key>.png); returns their paths."""
    written = []
    for key, plot in PLOTS.items():
        if key not in results["scenarios"]:
            continue
        fig = plot(results["scenarios"][key])
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
