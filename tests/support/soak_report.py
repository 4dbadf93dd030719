"""The soak's checks, its JSON summary and its plot (items/s, bridge RSS, failures over time).

Checks (each a name -> bool in summary["checks"]; summary["ok"] is all of them):
- nothing lost, duplicated, misassigned, silently 0.0, untyped; no broken stream contract;
- at least `min_items` items resolved;
- in each bridge life, the peak RSS of the last third of its samples after `warmup` s is at
  most `max_rss_growth` above the peak before it; the bridge's open fds in the last life's
  last third peak at most `max_fd_growth` above their peak before it (every life after
  warm-up);
- the chaos happened (server kills, one bridge restart, cancelled streams, bad items).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.soak_ledger import Ledger


def _lives(
    series: Sequence[dict[str, Any]], starts: Sequence[float], warmup: float
) -> list[dict[str, Any]]:
    """Per bridge process, over its samples after warm-up: the peak open fds and the peak RSS
    before the last third and in it, with their growth (peaks, because both follow the load:
    fds are mostly pooled upstream connections, which come and go with the servers and the
    adaptive limits: a first third of 7 s held 79 or 496 of them in two runs of the same code).
    Both are compared with everything before the last third, not the first third alone: a
    process without a leak reaches its high-water mark once (a new bridge's heap
    and pools still fill after warm-up, and a killed server's catch-up burst lands in whichever
    third it lands in; a 60 s soak's first third of a life is 7 s, shorter than a kill cycle),
    while a leak keeps setting new ones to the end. `measured` False when it lived too briefly
    after warm-up (less than warmup again) to say."""
    lives = []
    pids = list(dict.fromkeys(row["pid"] for row in series))
    for pid, start in zip(pids, starts, strict=False):
        rows = [r for r in series if r["pid"] == pid and r["rss"] is not None]
        after = [r for r in rows if r["t"] >= start + warmup]
        life: dict[str, Any] = {"pid": pid, "started_s": round(start, 1), "samples": len(rows)}
        third = len(after) // 3
        if third >= 1 and after[-1]["t"] - after[0]["t"] >= warmup:
            first, last = after[:third], after[-third:]
            rss = (max(r["rss"] for r in after[:-third]), max(r["rss"] for r in last))
            fds = (max(r["fds"] for r in after[:-third]), max(r["fds"] for r in last))
            life.update(
                measured=True,
                window_s=[first[0]["t"], first[-1]["t"], last[0]["t"], last[-1]["t"]],
                rss_mb=[round(v / 2**20, 1) for v in rss],
                peak_rss_mb=round(max(r["rss"] for r in rows) / 2**20, 1),
                rss_growth=round(rss[1] / rss[0] - 1, 4),
                fds=list(fds),
                fd_growth=fds[1] - fds[0],
            )
        else:
            life["measured"] = False
        lives.append(life)
    return lives


def summarize(
    config: dict[str, Any],
    ledger: Ledger,
    *,
    events: Sequence[tuple[float, str]],
    bridge_starts: Sequence[float],
    seconds: float,
    stragglers: Sequence[str],
) -> dict[str, Any]:
    """The summary dict (JSON-ready): config, counts, causes, lives, checks, ok, series."""
    counts = dict(ledger.counts)
    lost = ledger.lost()
    lives = _lives(ledger.series, bridge_starts, config["warmup"])
    measured = [life for life in lives if life["measured"]]
    # fds across the run: the last life's last-third peak against every peak before it (a
    # leak keeps setting new high-water marks; a pool refilled after a restart does not)
    run_fd_growth = None
    if measured:
        before = [max(life["fds"]) for life in measured[:-1]] + [measured[-1]["fds"][0]]
        run_fd_growth = measured[-1]["fds"][1] - max(before)
    kills = sum(1 for _, what in events if what.startswith("SIGKILL"))
    not_up = sum(1 for _, what in events if "NOT up" in what)
    zero = ("results_duplicated", "results_unknown_id", "misassigned", "silent_zero")
    checks = {
        "lost == 0": lost == 0,
        **{f"{name} == 0": counts.get(name, 0) == 0 for name in zero},
        "failures_untyped == 0": counts.get("failures_untyped", 0) == 0,
        "unanswered_in_ok_call == 0": counts.get("unanswered_in_ok_call", 0) == 0,
        "reward function never raised": counts.get("reward_fn_raised", 0) == 0,
        "no worker left running": not stragglers,
        f"resolved >= {config['min_items']}": len(ledger.resolved) >= config["min_items"],
        "a bridge life measured": bool(measured),
        f"RSS growth <= {config['max_rss_growth']:.0%}": all(
            life["rss_growth"] <= config["max_rss_growth"] for life in measured
        ),
        f"fd growth <= {config['max_fd_growth']}": run_fd_growth is not None
        and run_fd_growth <= config["max_fd_growth"],
        "mcqa killed": kills >= max(1, int(config["duration"] // config["kill_every"]) - 1),
        "every killed server up again": not_up == 0,
        "bridge restarted": len(bridge_starts) == 2,
        "streams cancelled": counts.get("streams_cancelled", 0) >= 1,
        "bad items rejected": counts.get("bad_rejected", 0) >= 1,
    }
    return {
        "config": config,
        "seconds": round(seconds, 1),
        "resolved": len(ledger.resolved),
        "items_per_second": round(len(ledger.resolved) / seconds, 1) if seconds else 0.0,
        "lost": lost,
        "counts": counts,
        "causes": dict(ledger.causes.most_common()),
        "events": sorted([list(e) for e in events]),
        "lives": lives,
        "fd_growth": run_fd_growth,
        "notes": ledger.notes,
        "stragglers": list(stragglers),
        "checks": checks,
        "ok": all(checks.values()),
        "series": ledger.series,
    }


def render(summary: dict[str, Any]) -> str:
    """The checks and headline numbers as text."""
    lines = [
        f"soak: {summary['resolved']} items resolved in {summary['seconds']} s "
        f"({summary['items_per_second']}/s), {summary['lost']} lost; "
        f"counts {summary['counts']}",
        f"failure causes: {summary['causes']}",
        f"events: {summary['events']}",
    ]
    for life in summary["lives"]:
        lines.append(f"bridge life: {life}")
    for check, passed in summary["checks"].items():
        lines.append(f"  {'ok  ' if passed else 'FAIL'} {check}")
    lines.extend(f"note: {note}" for note in summary["notes"])
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    """A PNG of items resolved per second, bridge RSS (MB) and failures per second over the
    run, chaos events as vertical lines. Needs matplotlib (the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["series"]
    t = [r["t"] for r in rows]

    def rate(key: str, window: float = 5.0) -> list[float]:
        """Per-second rate of a running total, averaged over the last `window` s."""
        out = []
        for k, row in enumerate(rows):
            j = k
            while j > 0 and row["t"] - rows[j - 1]["t"] <= window:
                j -= 1
            span = row["t"] - rows[j]["t"]
            out.append((row[key] - rows[j][key]) / span if span > 0 else 0.0)
        return out

    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    axes[0].plot(t, rate("resolved"))
    axes[0].set_ylabel("items resolved / s (5 s mean)")
    axes[1].plot(t, [r["rss"] / 2**20 if r["rss"] else float("nan") for r in rows])
    axes[1].set_ylabel("bridge RSS (MB)")
    axes[2].plot(t, rate("failures"), label="typed failures / s")
    axes[2].plot(t, rate("resent"), label="resent / s")
    axes[2].set_ylabel("per s")
    axes[2].legend()
    axes[2].set_xlabel("seconds")
    for when, what in summary["events"]:
        if what.startswith("SIGKILL") or what == "bridge SIGTERM":
            for ax in axes:
                ax.axvline(when, color="red" if "bridge" in what else "grey", alpha=0.3)
    fig.suptitle(
        f"soak: {summary['resolved']} items in {summary['seconds']} s, {summary['lost']} lost"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
