"""Shared fixtures: real NeMo Gym resources servers (started once per session) and bridges,
and the `nemo_gym` marker that splits off the fast tier.

Tiers are markers: `nemo_gym` (needs the real stack; the fast tier is `pytest -m "not
nemo_gym"`) is applied here to every test that requests a fixture of NEMO_GYM_FIXTURES (what
a test uses says what it needs), and set by a test module (`pytestmark`) or a test itself when
it reaches the stack otherwise. A test without the marker that reaches for the NeMo Gym venv or
servers anyway fails, saying so. `compat` (a module's `pytestmark`: the version-sensitive
paths, discovery, mcqa / equivalence scoring, sessions, multireward, the reward functions,
TRL, score) is the subset `make test` also runs on 0.4.0; `nemo_gym_07` (set by a test) names
a test that needs a 0.7-only feature, which is deselected (not skipped) when the selected
version is older.

Which NeMo Gym the real stack runs: env NEMO_GYM_VERSION (0.7.0 by default, or 0.4.0; see
tests/support/versions.py), exposed as `nemo_gym.version`. The venv needs its Python
(tests/support/versions.py). Without one the tests that need it are skipped, or fail when env
CI is set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from nemo_gym_grpc.v1 import verify_pb2_grpc
from tests.support import (
    DEFAULT_SERVERS,
    AgentStack,
    BridgeProcess,
    NemoGymServers,
    NoSuitablePython,
    ensure_venv,
)
from tests.support import start_bridge as _start_bridge
from tests.support.listeners import stray_sockets
from tests.support.missing import missing
from tests.support.reward_rows import axolotl_loader_rows
from tests.support.venv import forbid_nemo_gym
from tests.support.versions import selected_version, version_tuple

# Fixtures that reach the real NeMo Gym stack: a test requesting one (directly or through other
# fixtures) needs it, so it is marked `nemo_gym` here. A test that reaches the stack otherwise
# (a harness call in its body) carries the marker itself, as a module's `pytestmark` or a
# decorator; the guard below fails it if it does not.
NEMO_GYM_FIXTURES = frozenset(
    {"nemo_gym", "nemo_gym_venv", "bridge_target", "start_bridge", "agent_stack"}
)

_timings: list[str] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that requests a fixture of NEMO_GYM_FIXTURES with `nemo_gym`; deselect
    `nemo_gym_07` tests when NeMo Gym < 0.7 is selected."""
    old = version_tuple(selected_version()) < (0, 7)
    kept, dropped = [], []
    for item in items:
        (dropped if old and item.get_closest_marker("nemo_gym_07") else kept).append(item)
        if set(getattr(item, "fixturenames", ())) & NEMO_GYM_FIXTURES:
            item.add_marker(pytest.mark.nemo_gym)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(autouse=True)
def _nemo_gym_only_when_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    """For a test without the `nemo_gym` marker, building the NeMo Gym venv, reading its
    example rows or starting its servers raises NemoGymError."""
    if request.node.get_closest_marker("nemo_gym"):
        yield
        return
    forbid_nemo_gym(
        f"{request.node.nodeid} is not marked nemo_gym but uses the NeMo Gym venv or servers: "
        "request a fixture of tests/conftest.py NEMO_GYM_FIXTURES or mark the test nemo_gym "
        "(tests/data/ has an mcqa example row that needs no venv)"
    )
    try:
        yield
    finally:
        forbid_nemo_gym(None)


def _unavailable(exc: Exception) -> None:
    missing(f"real NeMo Gym servers unavailable: {exc}")


@pytest.fixture(scope="session")
def nemo_gym_venv(pytestconfig: pytest.Config) -> Path:
    """The cached venv of the selected NeMo Gym version (built on first use). What building it
    says (a first build takes minutes: its steps and a progress line every 30 s) goes to the
    terminal, not to pytest's capture."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    try:
        with capture.global_and_fixture_disabled():  # what `capsys.disabled()` uses
            return ensure_venv()
    except NoSuitablePython as exc:
        problem = exc
    _unavailable(problem)  # outside the except block: no chained traceback in the report
    raise AssertionError("unreachable")  # _unavailable always raises


@pytest.fixture(scope="session")
def nemo_gym(nemo_gym_venv: Path) -> Iterator[NemoGymServers]:
    """ng_run with the head server and every server in DEFAULT_SERVERS, started once per
    test session; `.version` is its NeMo Gym version."""
    servers = NemoGymServers(DEFAULT_SERVERS, venv=nemo_gym_venv)
    servers.start()
    try:
        yield servers
    finally:
        servers.stop()
        _timings.append(
            f"NeMo Gym {servers.version} ng_run with {len(servers.servers)} resources servers: "
            f"ready in {servers.startup_seconds} s, stopped in {servers.stop_seconds} s"
        )


@pytest.fixture(scope="session")
def agent_stack(nemo_gym_venv: Path) -> Iterator[AgentStack]:
    """The real NeMo Gym agent stack (tests/support/agents.py: vllm_model over the scripted
    policy, simple_agent over example_single_tool_call; on 0.7 also the single_agent_turn
    environment server and the masked math_agent), started once per test session. A test that
    changes `agent_stack.policy.knobs` restores them (`policy.reset()` also clears the log)."""
    stack = AgentStack(venv=nemo_gym_venv)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()
        gym = stack.gym
        if gym is not None:
            _timings.append(
                f"NeMo Gym {stack.version} agent stack ({len(gym.servers) + len(gym.extra_config)}"
                f" servers): ready in {gym.startup_seconds} s, stopped in {gym.stop_seconds} s"
            )


@pytest.fixture(scope="module")
def agent_bridge(agent_stack: AgentStack) -> Iterator[BridgeProcess]:
    """A bridge, one per test module, that discovers the agent stack's agents and environment
    servers through its head server."""
    with _start_bridge("--head-url", agent_stack.head_url) as bridge:
        yield bridge


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


@pytest.fixture(scope="module", autouse=True)
def _network_rule() -> Iterator[None]:
    """After each test module (the session's stacks still up): no process of this test run has
    a socket beyond loopback in the machine's network namespace (tests/support/listeners.py);
    what runs in namespaces a test made (tests/support/hosts.py) is not listed there."""
    yield
    stray = stray_sockets()
    if stray:
        pytest.fail("sockets beyond loopback: " + "; ".join(map(str, stray)), pytrace=False)


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


@pytest.fixture(scope="module")
def loader_rows(nemo_gym_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reward-function tests' dataset rows (tests/support/reward_rows.py), per module."""
    return axolotl_loader_rows(nemo_gym_venv, lambda: tmp_path_factory.mktemp("rows"))


@pytest.fixture
def via_target(monkeypatch: pytest.MonkeyPatch, bridge_target: str) -> str:
    """reward_nemo_gym_verify uses the session's bridge (NEMO_GYM_GRPC_TARGET)."""
    # imported here, not at the top: the trainer-side client sets GRPC_ENABLE_FORK_SUPPORT as
    # it loads (rewards/client/per_process.py), which only the tests that use it should see
    from nemo_gym_grpc.rewards.client import settings

    monkeypatch.setenv(settings.TARGET_ENV, bridge_target)
    return bridge_target


@pytest.fixture
def zero_config(monkeypatch: pytest.MonkeyPatch, nemo_gym: NemoGymServers) -> Iterator[None]:
    """No target: the reward functions start embedded bridges; stopped after the test."""
    from nemo_gym_grpc.rewards.client import embedded, settings  # as in via_target

    monkeypatch.delenv(settings.TARGET_ENV, raising=False)
    monkeypatch.setenv(settings.HEAD_URL_ENV, nemo_gym.head_url)
    yield
    embedded.stop_all()
