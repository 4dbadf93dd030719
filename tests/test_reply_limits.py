"""A NeMo Gym reply over `--max-reply-mb` (as sent, or as decompressed) fails its item alone,
FAILED_PRECONDITION / UPSTREAM_REPLY_TOO_LARGE, without being read whole and without a retry,
with either upstream HTTP client; a reply under the limit still scores.

Through a real bridge process and real gRPC over loopback. The upstream is scripted
(tests/support/fault_proxy.py with no upstream; a second proxy in front of it re-sends its
replies chunked, without a Content-Length): no NeMo Gym server sends a reply of a chosen size
or a gzip bomb on demand.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.items import error_info, scored, scoring_reply
from tests.support.prometheus_scrape import metrics_url, scrape, value

MiB = 1024 * 1024
ROW = json.dumps({"question": "2+2?", "expected_answer": "A"})


def item(name: str, server: str = "scripted") -> verify_pb2.VerifyRequest:
    return verify_pb2.VerifyRequest(
        request_id=name, resources_server=server, completion=f"case-{name}", row_json=ROW
    )


@pytest.fixture
def upstreams() -> Iterator[tuple[FaultProxy, FaultProxy]]:
    """(scripted upstream, a proxy that re-sends its replies chunked)."""
    with FaultProxy(None) as scripted, FaultProxy(scripted.url) as chunked:
        gzipped = {"Content-Encoding": "gzip"}
        scripted.set_faults(
            Fault("status", match='"case-sized"', body=scoring_reply(2 * MiB)),
            Fault(
                "status",
                match='"case-bomb"',
                body=gzip.compress(scoring_reply(64 * MiB)),
                headers=gzipped,
            ),
            Fault("status", match='"case-streamed"', body=scoring_reply(2 * MiB)),
            Fault("status", match='"case-fits"', body=scoring_reply(MiB - 1024)),
            Fault(
                "status",
                match='"case-fits_gzip"',
                body=gzip.compress(scoring_reply(MiB - 1024)),
                headers=gzipped,
            ),
        )
        chunked.set_faults(Fault("chunked", pieces=64))
        yield scripted, chunked


@pytest.mark.parametrize("client", ["builtin", "aiohttp"])
def test_a_reply_over_the_limit_fails_its_item_alone_and_is_not_retried(
    start_bridge, upstreams, client
):
    scripted, chunked = upstreams
    bridge = start_bridge(
        "--server", f"scripted={scripted.url}",
        "--server", f"chunked={chunked.url}",
        "--max-reply-mb", "1",
        "--upstream-client", client,
    )  # fmt: skip
    items = [
        item("sized"),
        item("bomb"),
        item("streamed", "chunked"),
        item("fits"),
        item("fits_gzip"),
    ]
    with grpc.insecure_channel(bridge.target) as channel:
        results = scored(verify_pb2_grpc.VerifyServiceStub(channel), items)
    for name in ("sized", "bomb", "streamed"):
        result, info = results[name], error_info(results[name])
        assert (result.error.code, info.reason) == (
            code_pb2.FAILED_PRECONDITION,
            "UPSTREAM_REPLY_TOO_LARGE",
        ), (name, result.error.message)
        assert info.metadata["limitBytes"] == str(MiB)
        assert "--max-reply-mb 1 MiB" in result.error.message
        sent_to = chunked if name == "streamed" else scripted
        assert sent_to.attempts[name] == 1, name  # not retried
    assert "Content-Length 2097" in results["sized"].error.message
    assert "Content-Length" not in results["streamed"].error.message  # read until over
    assert [results[name].reward for name in ("fits", "fits_gzip")] == [1.0, 1.0]


def test_replies_beyond_the_reply_budget_wait_their_turn_and_all_score(start_bridge):
    """12 replies of 3 MiB, each sent over ~0.4 s, against `--max-replies-mb 8`: at most two
    are read at once (the bridge's gauges, scraped while they come), the rest wait, all
    score."""
    with FaultProxy(None) as scripted, FaultProxy(scripted.url) as slow:
        scripted.set_faults(Fault("status", body=scoring_reply(3 * MiB)))
        slow.set_faults(Fault("trickle", pieces=8, pace=0.05))
        bridge = start_bridge(
            "--server", f"scripted={slow.url}",
            "--max-reply-mb", "4", "--max-replies-mb", "8", "--metrics-port", "0",
        )  # fmt: skip
        url = metrics_url(bridge)
        items = [item(f"r{n}") for n in range(12)]
        with grpc.insecure_channel(bridge.target) as channel:
            stub = verify_pb2_grpc.VerifyServiceStub(channel)
            with ThreadPoolExecutor(1) as pool:
                scoring = pool.submit(scored, stub, items)
                seen = []
                while not scoring.done():
                    samples = scrape(url)
                    seen.append(
                        (
                            value(samples, "nemo_gym_grpc_reply_bytes"),
                            value(samples, "nemo_gym_grpc_replies_waiting"),
                        )
                    )
                    time.sleep(0.05)
                results = scoring.result()
    assert [results[i.request_id].reward for i in items] == [1.0] * 12
    assert max(held for held, _ in seen) <= 8 * MiB, seen
    assert max(held for held, _ in seen) >= 3 * MiB, seen  # replies were seen being read
    assert max(waiting for _, waiting in seen) >= 1, seen
