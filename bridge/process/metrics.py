"""Prometheus metrics of one bridge process, served on `serve --metrics-port P` at `/metrics`.

- `nemo_gym_grpc_items_total` (counter): items answered, by `resources_server`, `outcome`
  (ok/error), `code` (gRPC code name) and `reason` (ErrorInfo reason, "" when ok);
- `nemo_gym_grpc_upstream_latency_seconds` (histogram): one upstream HTTP call, by
  `resources_server` and `route` (/verify, /seed_session, /close_session; /reset, /step);
- `nemo_gym_grpc_upstream_retries_total` (counter): attempts after an item's first, by
  `resources_server` and `reason` (of the failure that was retried);
- `nemo_gym_grpc_session_closes_total` (counter): `/close_session` calls the bridge made in
  the background, by `resources_server` and `reason` ("" = closed, else why not);
- `nemo_gym_grpc_tool_calls_total` (counter): session tool calls (SessionService), by
  `resources_server`, `tool` ("(unknown)" for a route the server does not have) and `code`;
  `nemo_gym_grpc_open_sessions` (gauge): sessions open; session calls' latency is in
  `nemo_gym_grpc_upstream_latency_seconds` (route "/(tool)" for tool calls);
- `nemo_gym_grpc_unseeded_items_total` (counter): items run without a session on a server
  whose `/seed_session` takes a body of its own (it keeps per-session state), by
  `resources_server`;
- `nemo_gym_grpc_upstream_in_flight` / `nemo_gym_grpc_upstream_waiting` (gauges): calls
  holding a slot / items waiting for one, by `upstream` (base URL of the replica);
- `nemo_gym_grpc_upstream_limit` / `nemo_gym_grpc_upstream_no_load_seconds` (gauges):
  each replica's adaptive limit and the no-load latency it was found from (`flows/limits.py`;
  none with `--fixed-concurrency`), by `upstream`;
- `nemo_gym_grpc_sharing_limiters` (gauge): the adaptive limiters that share each upstream's
  standing queue, this process's included (`--sharing-bridges`, or the number in
  `--sharing-bridges-file`, times `--workers`; none with `--fixed-concurrency`);
- `nemo_gym_grpc_active_streams` / `nemo_gym_grpc_streams_waiting` (gauges): VerifyStream
  and RunStream calls open / waiting for a place (`--max-streams`);
- `nemo_gym_grpc_reply_bytes` / `nemo_gym_grpc_replies_waiting` (gauges): bytes of NeMo Gym
  reply bodies reserved for reading now / replies waiting for room (`--max-replies-mb`,
  `nemo_gym.replies`);
- `nemo_gym_grpc_rollouts_total` (counter): rollouts answered (Run, RunStream), by `agent`,
  `outcome`, `code` and `reason` as for items;
- `nemo_gym_grpc_rollout_latency_seconds` (histogram): one rollout's `/run` call, by `agent`;
- `nemo_gym_grpc_rollouts_in_flight` / `nemo_gym_grpc_rollouts_waiting` (gauges): rollouts
  holding one of their agent's `--agent-concurrency` slots / waiting for one, by `agent`;
  `nemo_gym_grpc_rollouts_straggling` (gauge): those running far longer than their agent's
  others (`nemo_gym_grpc.shared.stragglers`), as of its last check.

A name that is not routable is counted as `resources_server="(unknown)"` (`agent="(unknown)"`),
so request text cannot grow the label set. Each process has its own registry; with
`--workers N` worker i serves its own metrics on port P+i (see cli.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from nemo_gym_grpc.bridge.flows.balancer import Balancer
from nemo_gym_grpc.bridge.nemo_gym.replies import ReplyBudget

UNKNOWN_SERVER = "(unknown)"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Rollouts take seconds to hours.
ROLLOUT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 10800)


class Metrics:
    """The bridge's metrics in their own registry (`self.registry`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.items = Counter(
            "nemo_gym_grpc_items",
            "Items answered, by resources server, outcome (ok/error), gRPC code and reason.",
            ["resources_server", "outcome", "code", "reason"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "nemo_gym_grpc_upstream_latency_seconds",
            "Seconds of one upstream HTTP call (from its slot to its whole reply), any outcome.",
            ["resources_server", "route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.retries = Counter(
            "nemo_gym_grpc_upstream_retries",
            "Upstream attempts after an item's first, by the reason of the failure retried.",
            ["resources_server", "reason"],
            registry=self.registry,
        )
        self.closes = Counter(
            "nemo_gym_grpc_session_closes",
            "Background /close_session calls, by resources server and failure reason ('' = ok).",
            ["resources_server", "reason"],
            registry=self.registry,
        )
        self.tool_calls = Counter(
            "nemo_gym_grpc_tool_calls",
            "Session tool calls, by resources server, tool and outcome (gRPC code name).",
            ["resources_server", "tool", "code"],
            registry=self.registry,
        )
        self.unseeded = Counter(
            "nemo_gym_grpc_unseeded_items",
            "Items run without a session on a server whose /seed_session takes its own body.",
            ["resources_server"],
            registry=self.registry,
        )
        self.rollouts = Counter(
            "nemo_gym_grpc_rollouts",
            "Rollouts answered, by agent, outcome (ok/error), gRPC code and reason.",
            ["agent", "outcome", "code", "reason"],
            registry=self.registry,
        )
        self.rollout_latency = Histogram(
            "nemo_gym_grpc_rollout_latency_seconds",
            "Seconds of one rollout's /run call (from its agent slot to its whole reply).",
            ["agent"],
            buckets=ROLLOUT_BUCKETS,
            registry=self.registry,
        )
        # Labelled children by label values: `labels()` validates and locks on every call.
        self._children: dict[tuple[str, ...], Any] = {}

    def watch(
        self, balancer: Balancer, streams: Callable[[], tuple[int, int]], replies: ReplyBudget
    ) -> None:
        """Report the load gauges from `balancer`'s replicas, `streams()` (open, waiting for
        a place) and `replies` at each scrape (read from the live counters, so they cannot
        drift from them)."""
        self.registry.register(_LoadCollector(balancer, streams, replies))

    def watch_rollouts(self, load: Callable[[], Mapping[str, tuple[int, int, int]]]) -> None:
        """Report the rollout gauges from `load()`: {agent: (in flight, waiting, straggling)},
        read at each scrape."""
        self.registry.register(_RolloutCollector(load))

    def rollout(self, agent: str, code: str, reason: str) -> None:
        """Count one answered rollout (`code`, `reason` as for `item`)."""
        outcome = "ok" if code == "OK" else "error"
        self._child(self.rollouts, "rollouts", agent, outcome, code, reason).inc()

    def rollout_call(self, agent: str, seconds: float) -> None:
        """Record one rollout `/run` call that took `seconds`."""
        self._child(self.rollout_latency, "rollout_latency", agent).observe(seconds)

    def item(self, resources_server: str, code: str, reason: str) -> None:
        """Count one answered item. `code` is a gRPC code name ("OK" on success); `reason`
        the ErrorInfo reason ("" on success)."""
        outcome = "ok" if code == "OK" else "error"
        self._child(self.items, "items", resources_server, outcome, code, reason).inc()

    def call(self, resources_server: str, route: str, seconds: float) -> None:
        """Record one upstream HTTP call to `route` ("/verify", "/seed_session") that took
        `seconds`."""
        self._child(self.latency, "latency", resources_server, route).observe(seconds)

    def retry(self, resources_server: str, reason: str) -> None:
        """Count one attempt after an item's first; `reason` is why the previous one failed."""
        self._child(self.retries, "retries", resources_server, reason).inc()

    def close(self, resources_server: str, reason: str) -> None:
        """Count one background `/close_session` call; `reason` is "" when it closed, else
        the ErrorInfo-style reason of its failure."""
        self._child(self.closes, "closes", resources_server, reason).inc()

    def tool_call(self, resources_server: str, tool: str, code: str) -> None:
        """Count one session tool call (`tool` "(unknown)" when the server has no such
        route, so request text cannot grow the label set)."""
        self._child(self.tool_calls, "tools", resources_server, tool, code).inc()

    def watch_sessions(self, count: Callable[[], int]) -> None:
        """Report `nemo_gym_grpc_open_sessions` from `count()` at each scrape."""
        self.registry.register(_SessionsCollector(count))

    def unseeded_item(self, resources_server: str) -> None:
        """Count one item run without a session on a server that keeps per-session state."""
        self._child(self.unseeded, "unseeded", resources_server).inc()

    def _child(self, metric: Any, kind: str, *labels: str) -> Any:
        key = (kind, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


class _LoadCollector:
    def __init__(
        self, balancer: Balancer, streams: Callable[[], tuple[int, int]], replies: ReplyBudget
    ) -> None:
        self._balancer = balancer
        self._streams = streams
        self._replies = replies

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "nemo_gym_grpc_upstream_in_flight",
            "Upstream calls holding a slot (HTTP request outstanding), by base URL.",
            labels=["upstream"],
        )
        waiting = GaugeMetricFamily(
            "nemo_gym_grpc_upstream_waiting",
            "Items waiting for a slot of an upstream (its concurrency limit), by base URL.",
            labels=["upstream"],
        )
        limit = GaugeMetricFamily(
            "nemo_gym_grpc_upstream_limit",
            "The adaptive concurrency limit of an upstream, by base URL.",
            labels=["upstream"],
        )
        no_load = GaugeMetricFamily(
            "nemo_gym_grpc_upstream_no_load_seconds",
            "The no-load latency an upstream's adaptive limit is found from, by base URL.",
            labels=["upstream"],
        )
        for replica in self._balancer.replicas():
            in_flight.add_metric([replica.url], replica.in_flight)
            waiting.add_metric([replica.url], replica.waiting)
            if replica.limit is not None and replica.limit.no_load < float("inf"):
                limit.add_metric([replica.url], replica.limit.limit)
                no_load.add_metric([replica.url], replica.limit.no_load)
        yield from (in_flight, waiting, limit, no_load)
        if self._balancer.share is not None:
            yield GaugeMetricFamily(
                "nemo_gym_grpc_sharing_limiters",
                "The limiters that share each upstream's standing queue, this one included "
                "(--sharing-bridges times --workers).",
                value=self._balancer.share,
            )
        active, waiting_streams = self._streams()
        yield GaugeMetricFamily(
            "nemo_gym_grpc_active_streams",
            "Open VerifyStream and RunStream calls.",
            value=active,
        )
        yield GaugeMetricFamily(
            "nemo_gym_grpc_streams_waiting",
            "VerifyStream and RunStream calls waiting for a place (--max-streams).",
            value=waiting_streams,
        )
        yield GaugeMetricFamily(
            "nemo_gym_grpc_reply_bytes",
            "Bytes of NeMo Gym reply bodies reserved for reading now (--max-replies-mb).",
            value=self._replies.held,
        )
        yield GaugeMetricFamily(
            "nemo_gym_grpc_replies_waiting",
            "NeMo Gym replies waiting for room before their bodies are read.",
            value=self._replies.waiting,
        )


class _SessionsCollector:
    def __init__(self, count: Callable[[], int]) -> None:
        self._count = count

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "nemo_gym_grpc_open_sessions",
            "Sessions open (SessionService), until closed or idle past their lease.",
            value=self._count(),
        )


class _RolloutCollector:
    def __init__(self, load: Callable[[], Mapping[str, tuple[int, int, int]]]) -> None:
        self._load = load

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "nemo_gym_grpc_rollouts_in_flight",
            "Rollouts holding one of their agent's --agent-concurrency slots, by agent.",
            labels=["agent"],
        )
        waiting = GaugeMetricFamily(
            "nemo_gym_grpc_rollouts_waiting",
            "Rollouts waiting for one of their agent's --agent-concurrency slots, by agent.",
            labels=["agent"],
        )
        straggling = GaugeMetricFamily(
            "nemo_gym_grpc_rollouts_straggling",
            "Rollouts running far longer than their agent's others (nemo_gym_grpc.shared."
            "stragglers), by agent.",
            labels=["agent"],
        )
        for agent, (running, queued, slow) in sorted(self._load().items()):
            in_flight.add_metric([agent], running)
            waiting.add_metric([agent], queued)
            straggling.add_metric([agent], slow)
        yield in_flight
        yield waiting
        yield straggling


async def start_metrics_server(metrics: Metrics, host: str, port: int) -> web.AppRunner:
    """Serve `GET /metrics` on host:port on the running event loop.

    Returns the runner (call `cleanup()` to stop); the bound port is
    `runner.addresses[0][1]`. Raises OSError when the address cannot be bound.
    """

    async def scrape(_request: web.Request) -> web.Response:
        return web.Response(
            body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    return runner
