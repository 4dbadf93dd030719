"""Prometheus metrics and structured stream logs of a real bridge, scraped over real HTTP after
real traffic to the real NeMo Gym mcqa server (and to a closed port for failures)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import grpc
from google.rpc import code_pb2

from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import closed_port
from tests.support.items import mcqa_item
from tests.support.prometheus_scrape import Samples, metrics_url, scrape, value, wait_for

ITEMS = "nemo_gym_grpc_items_total"
LATENCY_COUNT = "nemo_gym_grpc_upstream_latency_seconds_count"
RETRIES = "nemo_gym_grpc_upstream_retries_total"


def _mixed_items() -> list[verify_pb2.VerifyRequest]:
    """12 items: 6 that score (4 right, 2 wrong answers) and 6 that fail (3 to the closed port
    "down", 1 unknown resources server, 1 unparsable row, 1 duplicate request_id)."""
    items = [mcqa_item(f"right{i}") for i in range(4)] + [
        mcqa_item(f"wrong{i}", answer=False) for i in (0, 1)
    ]
    items += [mcqa_item(f"down{i}", resources_server="down") for i in range(3)]
    items += [
        mcqa_item("unknown", resources_server="no/such/server"),
        mcqa_item("not-json", row_json="{"),
        mcqa_item("right0"),  # right0 is still in flight: a duplicate request_id
    ]
    return items


def _stream_then_scrape(
    target: str, items: list[verify_pb2.VerifyRequest], url: str
) -> tuple[list[verify_pb2.VerifyResponse], Samples]:
    """Send `items` on one VerifyStream and read a result for each; scrape `url` while the
    stream is still open, then half-close it. Returns (results, the samples scraped)."""
    release = threading.Event()

    def messages():
        yield verify_pb2.VerifyStreamRequest(items=items)
        release.wait(60)  # the stream stays open until the scrape below

    with grpc.insecure_channel(target) as channel:
        call = verify_pb2_grpc.VerifyServiceStub(channel).VerifyStream(messages(), timeout=60)
        results = []
        for message in call:
            results += message.results
            if len(results) == len(items):
                break
        open_stream = scrape(url)
        release.set()
        assert list(call) == []
    return results, open_stream


def _check_items_counted(samples: Samples) -> None:
    """ITEMS by outcome, status code and reason for the items of _mixed_items."""
    ok = {"outcome": "ok", "code": "OK", "reason": ""}
    assert value(samples, ITEMS, resources_server="mcqa", **ok) == 6
    assert value(samples, ITEMS, outcome="ok") == 6
    assert value(samples, ITEMS, outcome="error") == 6
    assert (
        value(
            samples,
            ITEMS,
            resources_server="down",
            code="UNAVAILABLE",
            reason="UPSTREAM_UNAVAILABLE",
        )
        == 3
    )
    assert (
        value(
            samples,
            ITEMS,
            resources_server="(unknown)",
            code="NOT_FOUND",
            reason="UNKNOWN_RESOURCES_SERVER",
        )
        == 1
    )
    assert (
        value(
            samples, ITEMS, resources_server="mcqa", code="INVALID_ARGUMENT", reason="INVALID_ITEM"
        )
        == 2
    )


def _check_upstream_metrics(samples: Samples, mcqa: str, down: str) -> None:
    """Latency counts, retries, in-flight and waiting gauges per upstream (`mcqa`: the mcqa
    server's URL, `down`: the closed port's), no label for the unknown server's name."""
    assert value(samples, LATENCY_COUNT, resources_server="mcqa", route="/verify") == 6
    assert value(samples, LATENCY_COUNT, resources_server="down", route="/verify") == 9
    assert value(samples, RETRIES, resources_server="down", reason="UPSTREAM_UNAVAILABLE") == 6
    assert value(samples, RETRIES, resources_server="mcqa") == 0
    in_flight = {
        dict(labels)["upstream"]: v
        for (name, labels), v in samples.items()
        if name == "nemo_gym_grpc_upstream_in_flight"
    }
    assert in_flight == {mcqa: 0, down: 0}
    assert value(samples, "nemo_gym_grpc_upstream_waiting") == 0
    assert not any("no/such/server" in dict(labels).values() for _, labels in samples)


def _check_stream_log(bridge) -> None:
    """SIGTERM the bridge; its JSON log has one verify_stream_end record with the counts."""
    os.kill(bridge.pid, signal.SIGTERM)
    assert bridge.proc.wait(timeout=30) == 0
    records = [json.loads(line) for line in bridge.stderr_path.read_text().splitlines()]
    ended = [r for r in records if r.get("event") == "verify_stream_end"]
    assert len(ended) == 1, ended
    assert ended[0]["items_received"] == 12 and ended[0]["results_sent"] == 12
    assert ended[0]["results_failed"] == 6
    assert ended[0]["duration_seconds"] > 0 and ended[0]["peer"].startswith("ipv")


def test_metrics_count_every_outcome_and_the_stream_log_has_fields(start_bridge, nemo_gym):
    down = f"http://127.0.0.1:{closed_port()}"
    bridge = start_bridge(
        "--head-url",
        nemo_gym.head_url,
        "--server",
        f"down={down}",
        "--metrics-port",
        "0",
        "--log-format",
        "json",
        "--health-interval",
        "600",
    )
    url = metrics_url(bridge)
    items = _mixed_items()
    results, open_stream = _stream_then_scrape(bridge.target, items, url)
    assert len(results) == 12 and sum(r.HasField("error") for r in results) == 6

    samples = wait_for(url, lambda s: value(s, "nemo_gym_grpc_active_streams") == 0)
    assert value(open_stream, "nemo_gym_grpc_active_streams") == 1
    assert value(samples, "nemo_gym_grpc_active_streams") == 0
    _check_items_counted(samples)
    _check_upstream_metrics(samples, nemo_gym.server_urls["mcqa"], down)
    _check_stream_log(bridge)


def _two_free_ports() -> int:
    """A port P such that P and P+1 are both free now."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two adjacent free ports")


def test_each_worker_serves_its_own_metrics_on_the_next_port(start_bridge):
    port = _two_free_ports()
    bridge = start_bridge(
        "--server",
        f"down=http://127.0.0.1:{closed_port()}",
        "--workers",
        "2",
        "--metrics-port",
        str(port),
        "--retry-attempts",
        "1",
        "--sharing-bridges",
        "3",
    )
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        item = verify_pb2.VerifyRequest(request_id="x", resources_server="down")
        assert stub.Verify(item, timeout=30).error.code == code_pb2.UNAVAILABLE
    scraped = [scrape(f"http://127.0.0.1:{p}/metrics") for p in (port, port + 1)]
    counted = [value(samples, ITEMS, resources_server="down") for samples in scraped]
    assert sorted(counted) == [0, 1]  # one worker took the connection and counted the item
    # each worker has limits of its own: 3 bridges of 2 workers each keep 1/6 of a queue
    assert [value(samples, "nemo_gym_grpc_sharing_limiters") for samples in scraped] == [6, 6]


def test_a_running_bridge_follows_its_sharing_bridges_file(start_bridge, tmp_path):
    """What the Ray fleet's actors do when the fleet grows (bridge/process/share.py): the
    number in the file, times the workers, once it changes; a bad value keeps the last."""
    port, path = _two_free_ports(), tmp_path / "share"
    bridge = start_bridge(
        *("--workers", "2", "--metrics-port", str(port)),
        *("--sharing-bridges", "3", "--sharing-bridges-file", str(path)),
    )
    urls = [f"http://127.0.0.1:{p}/metrics" for p in (port, port + 1)]
    shares = [value(scrape(url), "nemo_gym_grpc_sharing_limiters") for url in urls]
    assert shares == [6, 6]  # no file yet: --sharing-bridges
    path.write_text("5\n")
    for url in urls:
        samples = wait_for(url, lambda s: value(s, "nemo_gym_grpc_sharing_limiters") == 10)
        assert value(samples, "nemo_gym_grpc_sharing_limiters") == 10
    path.write_text("five\n")
    deadline = time.monotonic() + 10
    while bridge.stderr_path.read_text().count("not a positive number") < 2:
        assert time.monotonic() < deadline, bridge.stderr_tail()
        time.sleep(0.05)
    assert [value(scrape(url), "nemo_gym_grpc_sharing_limiters") for url in urls] == [10, 10]
