"""The fault matrix's shared parts (tests/test_faults*.py): its upstreams and bridge as pytest
fixtures, which each module takes as its own (`row = fault_matrix.row`, ...: one instance per
module), and the checks every case ends with.

Real parts: a real NeMo Gym mcqa server behind a fault-injecting proxy
(tests/support/fault_proxy.py), a scripted upstream only for replies a real server cannot give
on demand, real bridge processes and real gRPC over loopback. Time bounds are generous (the
machine is shared) and only bound hangs (MARGIN); no case asserts speed.
"""

from __future__ import annotations

import time

import pytest

from tests.support import closed_port, start_bridge
from tests.support.fault_proxy import FaultProxy
from tests.support.items import error_info as info
from tests.support.items import mcqa_item as item
from tests.support.items import mcqa_row, scored

MARGIN = 5.0  # seconds of slack on every time bound


@pytest.fixture(scope="module")
def row() -> dict:
    return mcqa_row()


@pytest.fixture(scope="module")
def proxy(nemo_gym):
    """The fault proxy in front of the real mcqa server (the bridge's "mcqa")."""
    with FaultProxy(nemo_gym.server_urls["mcqa"]) as running:
        yield running


@pytest.fixture(scope="module")
def scripted():
    """A scripted upstream (the bridge's "scripted"); unmatched requests get HTTP 502."""
    with FaultProxy(None) as running:
        yield running


@pytest.fixture(scope="module")
def bridge(proxy, scripted):
    """One bridge for the module's part of the matrix: it must keep serving after every fault."""
    with start_bridge(
        "--server",
        f"mcqa={proxy.url}",
        "--server",
        f"scripted={scripted.url}",
        "--server",
        f"down=http://127.0.0.1:{closed_port()}",
        "--health-interval",
        "600",
        "--fixed-concurrency",  # the tests count slots: a fixed 64, not an adaptive limit
        "64",
    ) as running:
        yield running


@pytest.fixture(autouse=True)
def no_faults(request):
    """Every test starts with no faults and zeroed counters on the module's upstreams."""
    for name in ("proxy", "scripted"):
        if name in request.fixturenames:
            request.getfixturevalue(name).set_faults()


def assert_failed(result, code: int, reason: str, **metadata: str) -> None:
    """`result` is a failure (never a reward) with this code, reason and metadata."""
    detail = info(result)
    assert (result.error.code, detail.reason) == (code, reason), result.error.message
    for key, value in metadata.items():
        assert detail.metadata[key] == value, (key, dict(detail.metadata))
    assert result.reward == 0.0 and not result.reward_components and not result.reply_json


def assert_rewarded(result, reward: float = 1.0) -> None:
    assert not result.HasField("error"), result.error.message
    assert result.reward == reward


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def assert_still_serves(stub, row, name: str = "after") -> None:
    results = scored(stub, [item(f"{name}-right", row), item(f"{name}-wrong", row, False)])
    assert_rewarded(results[f"{name}-right"], 1.0)
    assert_rewarded(results[f"{name}-wrong"], 0.0)
