"""Shared fixtures: real NeMo Gym resources servers (started once per session) and bridges.

The servers need a Python >= 3.12 for the NeMo Gym venv (see nemo_gym_servers.py). Without one
the tests that need them are skipped, or fail when env CI is set.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from nemo_gym_servers import (
    DEFAULT_SERVERS,
    BridgeProcess,
    NemoGymServers,
    NoSuitablePython,
    ensure_venv,
)
from nemo_gym_servers import start_bridge as _start_bridge

from nemo_gym_grpc.v1 import verify_pb2_grpc

_timings: list[str] = []


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


@pytest.fixture(scope="session")
def nemo_gym(nemo_gym_venv):
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
def bridge_target(nemo_gym) -> str:
    """host:port of a bridge that discovers the session's servers through the head server."""
    with _start_bridge("--head-url", nemo_gym.head_url) as bridge:
        yield bridge.target


@pytest.fixture
def start_bridge():
    """Factory: start_bridge(*args, env=None, timeout=30.0) -> BridgeProcess; every bridge it
    started is stopped at the end of the test."""
    started: list[BridgeProcess] = []

    def factory(*args: str, env=None, timeout: float = 30.0) -> BridgeProcess:
        bridge = _start_bridge(*args, env=env, timeout=timeout)
        started.append(bridge)
        return bridge

    yield factory
    for bridge in started:
        bridge.stop()


def pytest_terminal_summary(terminalreporter):
    for line in _timings:
        terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def stub(bridge):
    """A VerifyService stub on a channel to the test module's own `bridge` fixture, with the
    64 MiB message limits the bridge uses (gRPC's default receive limit is 4 MiB)."""
    limit = 64 * 1024 * 1024
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    with grpc.insecure_channel(bridge.target, options=options) as channel:
        yield verify_pb2_grpc.VerifyServiceStub(channel)
