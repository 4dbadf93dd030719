"""Shared fixtures: real NeMo Gym resources servers (started once per session) and bridges,
and the `nemo_gym` marker that splits off the fast tier.

Every test that needs the real stack carries the `nemo_gym` marker, applied here: tests whose
fixtures (directly or through other fixtures) include one of NEMO_GYM_FIXTURES, the tests in
NEMO_GYM_MODULES and those in NEMO_GYM_TESTS. `pytest -m "not nemo_gym"` (the fast tier) runs
the rest. A test without the marker that reaches for the NeMo Gym venv or servers anyway
fails, saying so.

The servers need a Python >= 3.12 for the NeMo Gym venv (see tests/support/venv.py). Without
one the tests that need them are skipped, or fail when env CI is set.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from nemo_gym_grpc.v1 import verify_pb2_grpc
from tests.support import (
    DEFAULT_SERVERS,
    BridgeProcess,
    NemoGymServers,
    NoSuitablePython,
    ensure_venv,
)
from tests.support import start_bridge as _start_bridge
from tests.support.venv import forbid_nemo_gym

NEMO_GYM_FIXTURES = frozenset({"nemo_gym", "nemo_gym_venv", "bridge_target", "start_bridge"})
# Modules whose tests reach NeMo Gym without those fixtures (e.g. example_rows() in the body).
NEMO_GYM_MODULES = frozenset({"test_score.py"})
# Tests that start a bridge process with tests.support.start_bridge itself, as the
# start_bridge fixture would (module file::test name).
NEMO_GYM_TESTS = frozenset(
    {"test_faults.py::test_10000_items_against_a_slow_upstream_keep_the_bridge_memory_bounded"}
)

_timings: list[str] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that needs the real NeMo Gym stack with `nemo_gym`."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        name = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
        if (
            fixtures & NEMO_GYM_FIXTURES
            or item.path.name in NEMO_GYM_MODULES
            or name in NEMO_GYM_TESTS
        ):
            item.add_marker(pytest.mark.nemo_gym)


@pytest.fixture(autouse=True)
def _nemo_gym_only_when_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    """For a test without the `nemo_gym` marker, building the NeMo Gym venv, reading its
    example rows or starting its servers raises NemoGymError."""
    if request.node.get_closest_marker("nemo_gym"):
        yield
        return
    forbid_nemo_gym(
        f"{request.node.nodeid} is not marked nemo_gym but uses the NeMo Gym venv or servers: "
        "request a fixture of tests/conftest.py NEMO_GYM_FIXTURES or list the module in "
        "NEMO_GYM_MODULES (tests/data/ has an mcqa example row that needs no venv)"
    )
    try:
        yield
    finally:
        forbid_nemo_gym(None)


def _unavailable(exc: Exception) -> None:
    message = f"real NeMo Gym servers unavailable: {exc}"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def nemo_gym_venv() -> Path:
    """The cached venv with nemo-gym 0.4.0 (built on first use)."""
    try:
        return ensure_venv()
    except NoSuitablePython as exc:
        problem = exc
    _unavailable(problem)  # outside the except block: no chained traceback in the report
    raise AssertionError("unreachable")  # _unavailable always raises


@pytest.fixture(scope="session")
def nemo_gym(nemo_gym_venv: Path) -> Iterator[NemoGymServers]:
    """ng_run with the head server and every server in DEFAULT_SERVERS, started once per
    test session."""
    servers = NemoGymServers(DEFAULT_SERVERS, venv=nemo_gym_venv)
    servers.start()
    try:
        yield servers
    finally:
        servers.stop()
        _timings.append(
            f"NeMo Gym ng_run with {len(servers.servers)} resources servers: ready in "
            f"{servers.startup_seconds} s, stopped in {servers.stop_seconds} s"
        )


@pytest.fixture(scope="session")
def bridge_target(nemo_gym: NemoGymServers) -> Iterator[str]:
    """host:port of a bridge that discovers the session's servers through the head server."""
    with _start_bridge("--head-url", nemo_gym.head_url) as bridge:
        yield bridge.target


@pytest.fixture
def start_bridge() -> Iterator[Callable[..., BridgeProcess]]:
    """Factory: start_bridge(*args, env=None, timeout=30.0) -> BridgeProcess; every bridge it
    started is stopped at the end of the test."""
    started: list[BridgeProcess] = []

    def factory(
        *args: str, env: dict[str, str | None] | None = None, timeout: float = 30.0
    ) -> BridgeProcess:
        bridge = _start_bridge(*args, env=env, timeout=timeout)
        started.append(bridge)
        return bridge

    yield factory
    for bridge in started:
        bridge.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _timings:
        terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def stub(bridge: BridgeProcess) -> Iterator[verify_pb2_grpc.VerifyServiceStub]:
    """A VerifyService stub on a channel to the test module's own `bridge` fixture, with the
    64 MiB message limits the bridge uses (gRPC's default receive limit is 4 MiB)."""
    limit = 64 * 1024 * 1024
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    with grpc.insecure_channel(bridge.target, options=options) as channel:
        yield verify_pb2_grpc.VerifyServiceStub(channel)
