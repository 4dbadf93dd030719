"""Reading a bridge's Prometheus metrics over real HTTP, for tests.

url = metrics_url(bridge)                 # from the bridge's own log line
samples = scrape(url)                     # {(name, ((label, value), ...)): value}
value(samples, "nemo_gym_grpc_items_total", resources_server="mcqa", outcome="ok")
"""

from __future__ import annotations

import re
import time

import requests
from prometheus_client.parser import text_string_to_metric_families

_LOGGED = re.compile(r"Prometheus metrics on (http://[^\s\"]+/metrics)")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metrics_url(bridge, timeout: float = 10.0) -> str:
    """The metrics URL a started bridge logged ("Prometheus metrics on http://.../metrics")."""
    deadline = time.monotonic() + timeout
    while True:
        found = _LOGGED.search(bridge.stderr_path.read_text(errors="replace"))
        if found:
            return found.group(1)
        if time.monotonic() > deadline:
            raise AssertionError(f"no metrics URL logged:\n{bridge.stderr_tail()}")
        time.sleep(0.05)


def scrape(url: str) -> Samples:
    """Every sample of one scrape of `url`, keyed by (sample name, sorted label pairs)."""
    reply = requests.get(url, timeout=10)
    reply.raise_for_status()
    assert reply.headers["Content-Type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels` (0 when none)."""
    wanted = set(labels.items())
    return sum(v for (n, pairs), v in samples.items() if n == name and wanted <= set(pairs))


def wait_for(url: str, predicate, timeout: float = 10.0) -> Samples:
    """Scrape until `predicate(samples)` holds; returns those samples (the last ones when it
    never held, so the caller's assert shows them)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if predicate(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def no_open_sessions(bridge) -> None:
    """Wait until `bridge` (started with `--metrics-port`) has no session open (its gauge),
    and assert it."""
    samples = wait_for(metrics_url(bridge), lambda s: value(s, "nemo_gym_grpc_open_sessions") == 0)
    assert value(samples, "nemo_gym_grpc_open_sessions") == 0
