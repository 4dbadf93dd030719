"""NeMo Gym's own launcher (`ng_run`: the head server, resources servers) on loopback, without
Ray; or inside a network namespace of the test's own (tests/support/hosts.py), with or without.

    with NemoGymServers(("mcqa",), version="0.4.0") as gym:   # version None: env, else 0.7.0
        gym.head_url, gym.server_urls["mcqa"], gym.version

No Ray on loopback: ng_run starts a local Ray cluster, and Ray binds the machine's external
interface whatever address it is given. So ng_run and its servers run with
tests/support/no_ray on PYTHONPATH, which makes NeMo Gym's `initialize_ray` a no-op (none of
the servers the tests run uses Ray for its work). With `netns=` the stack runs inside that
namespace, bound to `host` (an address there); `ray=True` (only with `netns`) keeps NeMo
Gym's own Ray, which then binds that namespace's addresses only.

Launch differences handled here: on 0.7 the head server's /readyz (503 until every server and
model endpoint is up) is awaited besides every server's `/`, and a config with model servers
(extra_config) gets `model_endpoint_readiness_timeout_seconds: 0` (0.7 would otherwise wait up
to 600 s for each model endpoint, e.g. a judge at a closed port; the harness waits itself).
Env NEMO_GYM_KEEP_WORKDIR=1 keeps a stack's working dir (with its ng_run.log) after stop.
ng_run gets UV_PYTHON_DOWNLOADS=never, so it never lets uv download a Python.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import requests
import yaml

from tests.support import ng_run, procs
from tests.support.errors import NemoGymError
from tests.support.procs import ProcInfo, free_ports, group_processes, tail
from tests.support.venv import check_allowed, ensure_venv, resources_server_dir, venv_version
from tests.support.versions import has_readiness_endpoints

DEFAULT_SERVERS = (
    "mcqa",
    "equivalence_rule",
    "example_single_tool_call",
    "reasoning_gym",
    "example_session_state_mgmt",
    "example_tool_call_multireward",
)
NG_RUN_LOG_GRACE = 10.0  # seconds to wait for ng_run's own "servers ready" line


def stock_server_config(server: str, venv: Path | None = None) -> dict[str, Any]:
    """The server's own resources-server block from its shipped configs/*.yaml (prefers
    configs/<server>.yaml, then resources_only.yaml, then the others), or {}."""
    configs = resources_server_dir(server, venv) / "configs"
    files = sorted(configs.glob("*.yaml"))
    order = {f"{server}.yaml": 0, "resources_only.yaml": 1}
    for path in sorted(files, key=lambda p: (order.get(p.name, 2), p.name)):
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError:
            continue
        for block in data.values():
            if isinstance(block, dict):
                inner = (block.get("resources_servers") or {}).get(server)
                if isinstance(inner, dict):
                    return dict(inner)
    return {}


class NemoGymServers:
    """NeMo Gym's own launcher (`ng_run`) running the given resources servers on loopback.

    ng_run starts the head server and one process per resources server (and, with `ray`, a
    local Ray cluster); all of them stay in one new process group/session led by ng_run (pid
    recorded), which `stop()` ends (SIGINT, then SIGKILL). Use as a context manager or call
    start()/stop(). `host` is the address every server binds; `netns` a network namespace to
    run in (then only ng_run's own log says when the servers are ready: they cannot be reached
    from here); `ray` keeps NeMo Gym's Ray (ValueError without `netns`); `extra_env` is laid
    over ng_run's environment.

    `version` picks the NeMo Gym (ensure_venv(version=...); None: env NEMO_GYM_VERSION, else
    0.7.0) unless `venv` is given; after start() `version` is the venv's NeMo Gym version.
    `config_overrides` {server: {key: value}} update a server's block. `extra_config` adds
    top-level ng_run blocks {instance: {server_type: {type_name: block}}} (e.g. a model server,
    or a second instance of a resources server): each gets `host`, a free port unless
    it sets one, entrypoint app.py unless set, a resources server its stock block underneath,
    and its URL in `server_urls[instance]`.
    """

    def __init__(
        self,
        servers: Iterable[str] = DEFAULT_SERVERS,
        *,
        venv: str | Path | None = None,
        version: str | None = None,
        startup_timeout: float = 180.0,
        stop_timeout: float = 20.0,
        config_overrides: Mapping[str, Mapping[str, Any]] | None = None,
        keep_workdir: bool | None = None,
        extra_config: Mapping[str, Mapping[str, Any]] | None = None,
        host: str = "127.0.0.1",
        netns: str | None = None,
        ray: bool = False,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        if ray and not netns:
            raise ValueError("NeMo Gym's Ray binds the machine's external interface: use netns=")
        self.host, self.netns, self.ray = host, netns, ray
        self.extra_env = dict(extra_env or {})
        self.servers = tuple(servers)
        if not self.servers or len(set(self.servers)) != len(self.servers):
            raise ValueError(f"need distinct server names, got {self.servers}")
        self.venv = Path(venv) if venv else None
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.version = version
        self.config_overrides = {k: dict(v) for k, v in (config_overrides or {}).items()}
        self.extra_config = {k: dict(v) for k, v in (extra_config or {}).items()}
        if keep_workdir is None:
            keep_workdir = os.environ.get("NEMO_GYM_KEEP_WORKDIR", "") not in ("", "0")
        self.keep_workdir = keep_workdir
        self.head_url = ""
        self.server_urls: dict[str, str] = {}
        self.workdir: Path | None = None
        self.config_path: Path | None = None
        self.log_path: Path | None = None
        self.pid: int | None = None
        self.startup_seconds: float | None = None
        self.stop_seconds: float | None = None
        self.returncode: int | None = None  # ng_run's exit status after stop()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    # context manager -------------------------------------------------------------------------
    def __enter__(self) -> NemoGymServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid} head={self.head_url}" if self._proc else "stopped"
        return f"NemoGymServers({self.servers}, {state})"

    def running(self) -> bool:
        """ng_run was started and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    # start -----------------------------------------------------------------------------------
    def build_config(self, head_port: int, ports: Mapping[str, int], venv: Path) -> dict[str, Any]:
        """The ng_run config: a block per resources server (no agents), the extra_config
        blocks, the head server; `ports` has one per server and extra instance."""
        config: dict[str, Any] = {}
        for name in self.servers:
            block = stock_server_config(name, venv)
            block.update(entrypoint=block.get("entrypoint") or "app.py")
            block.setdefault("domain", "other")  # required for resources servers
            block.update(host=self.host, port=ports[name], verified=False)
            block.update(self.config_overrides.get(name, {}))
            config[name] = {"resources_servers": {name: block}}
        for instance, (kind, type_name, given) in self._extra_blocks().items():
            block = stock_server_config(type_name, venv) if kind == "resources_servers" else {}
            block.update(entrypoint=block.get("entrypoint") or "app.py")
            if kind == "resources_servers":
                block.setdefault("domain", "other")
                block.update(verified=False)
            block.update(host=self.host, port=ports[instance])
            block.update(given)
            config[instance] = {kind: {type_name: block}}
        if self.extra_config and has_readiness_endpoints(self.version):
            config["model_endpoint_readiness_timeout_seconds"] = 0
        config["head_server"] = {"host": self.host, "port": head_port}
        return config

    def _extra_blocks(self) -> dict[str, tuple[str, str, dict[str, Any]]]:
        """extra_config as {instance: (server kind, type name, block)}."""
        found = {}
        for instance, outer in self.extra_config.items():
            if len(outer) != 1 or len(next(iter(outer.values()))) != 1:
                raise ValueError(f"extra_config[{instance!r}] must be {{kind: {{type: block}}}}")
            kind, inner = next(iter(outer.items()))
            type_name, block = next(iter(inner.items()))
            found[instance] = (kind, type_name, dict(block))
        return found

    def start(self) -> NemoGymServers:
        """Write the config, start ng_run and wait (at most startup_timeout s) until every
        server answers. Raises NemoGymError (with ng_run's log tail) if it exits or times out."""
        if self._proc is not None:
            raise NemoGymError("already started")
        check_allowed()
        venv = Path(self.venv or ensure_venv(version=self.version)).absolute()
        found = venv_version(venv)
        if self.version and found != self.version:
            raise NemoGymError(f"{venv} has nemo-gym {found}, not {self.version}")
        self.version = found
        for name in self.servers:
            resources_server_dir(name, venv)  # fail early on unknown names
        extra = self._extra_blocks()
        names = [*self.servers, *extra]
        ports = free_ports(len(names) + 1)
        head_port, server_ports = ports[0], dict(zip(names, ports[1:], strict=True))
        for instance, (_, _, block) in extra.items():
            server_ports[instance] = int(block.get("port") or server_ports[instance])

        self.workdir = Path(tempfile.mkdtemp(prefix="nemo_gym_"))
        self.config_path = self.workdir / "nemo_gym_servers.yaml"
        self.config_path.write_text(
            yaml.safe_dump(self.build_config(head_port, server_ports, venv), sort_keys=False)
        )
        kinds = [("resources_servers", n) for n in self.servers] + [k[:2] for k in extra.values()]
        ng_run.link_server_venvs(self.workdir, venv, kinds)
        command = ng_run.command(venv, self.config_path, self.netns)
        env = ng_run.environment(venv, self.workdir, self.ray, self.extra_env)
        self.log_path = self.workdir / "ng_run.log"
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        started = time.monotonic()
        self._proc = subprocess.Popen(
            procs.with_default_sigint(command),
            cwd=self.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own session + process group, pgid == pid
        )
        self.pid = self._proc.pid
        procs.live.add(self)
        self.head_url = f"http://{self.host}:{head_port}"
        self.server_urls = {n: f"http://{self.host}:{p}" for n, p in server_ports.items()}
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop(remove_workdir=False)
            raise
        self.startup_seconds = round(time.monotonic() - started, 2)
        return self

    def _ng_run_reports_ready(self) -> bool:
        """ng_run logged "All N / N servers ready!" and then finished printing its table of
        server instances (framed by three rules of 100 '#'), i.e. it is entering run_forever."""
        if self.log_path is None:
            return False
        try:
            text = self.log_path.read_bytes()
        except OSError:
            return False
        at = text.find(b"servers ready!")
        return at >= 0 and text.count(b"#" * 100, at) >= 3

    def _wait_ready(self, started: float) -> None:
        """Until every server's and the head's `GET /` says {"status": "ok"} and ng_run itself
        logged "All N / N servers ready!" and its server table (it polls every 3 s; a SIGINT
        before then lands in its start-up code, which skips its own shutdown of the servers).
        That log output is awaited at most NG_RUN_LOG_GRACE s after the HTTP checks pass.
        From 0.7 on, the head's /readyz must also answer 200 (503 while servers start)."""
        proc = self._proc
        assert proc is not None, "start() sets it"
        pending = {} if self.netns else {"head": self.head_url, **self.server_urls}
        if has_readiness_endpoints(self.version) and not self.netns:
            pending["head /readyz"] = f"{self.head_url}/readyz"
        deadline = started + self.startup_timeout
        http_ready_at: float | None = None
        with requests.Session() as http:
            http.trust_env = False  # loopback: never through an HTTP(S)_PROXY
            while True:
                if proc.poll() is not None:
                    raise NemoGymError(
                        f"ng_run exited with {proc.returncode} before the servers were "
                        f"ready ({self._where()}); log tail:\n{self.log_tail()}"
                    )
                for name, url in list(pending.items()):
                    with contextlib.suppress(requests.RequestException, ValueError):
                        if name == "head /readyz":
                            if http.get(url, timeout=2).status_code == 200:
                                del pending[name]
                        elif http.get(f"{url}/", timeout=2).json() == {"status": "ok"}:
                            del pending[name]
                if not pending:
                    http_ready_at = http_ready_at or time.monotonic()
                    if self._ng_run_reports_ready():
                        return
                    if time.monotonic() > http_ready_at + NG_RUN_LOG_GRACE and not self.netns:
                        return  # all servers answer; ng_run's wording may differ
                if time.monotonic() > deadline:
                    raise NemoGymError(
                        f"NeMo Gym servers not ready after {self.startup_timeout:.0f} s "
                        f"(still waiting for {sorted(pending)}; {self._where()}); log tail:\n"
                        f"{self.log_tail()}"
                    )
                time.sleep(0.25)

    def _where(self) -> str:
        return f"config {self.config_path}, log {self.log_path}"  # kept when start() fails

    def log_tail(self, lines: int = 80) -> str:
        """The last `lines` lines of ng_run's log."""
        return tail(self.log_path, lines) if self.log_path else "(not started)"

    def processes(self) -> list[ProcInfo]:
        """The live processes of this stack (ng_run, Ray, head and resources servers)."""
        return group_processes(self.pid) if self.pid else []

    # stop ------------------------------------------------------------------------------------
    def stop(self, remove_workdir: bool = True) -> None:
        """SIGINT to the recorded process group (ng_run stops its servers and Ray), wait up to
        stop_timeout, then SIGKILL whatever of the group/session is left. Idempotent."""
        proc, pid = self._proc, self.pid
        if proc is None or pid is None:
            return
        began = time.monotonic()
        deadline = began + self.stop_timeout
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        # ng_run exited: give the rest of its group (Ray shutting down) a few more seconds;
        # ng_run too slow: no more waiting. Then SIGKILL whatever is left.
        grace_end = min(deadline, time.monotonic() + 5) if proc.poll() is not None else 0
        while time.monotonic() < grace_end and group_processes(pid):
            time.sleep(0.1)
        self._kill_leftovers(pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        self.returncode = proc.returncode
        self.stop_seconds = round(time.monotonic() - began, 2)
        self._proc = None
        procs.live.discard(self)
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        if remove_workdir and not self.keep_workdir and self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    @staticmethod
    def _kill_leftovers(pid: int) -> None:
        left = group_processes(pid)
        if not left:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        for p in left:  # members that changed process group but kept the session
            if p.pgid != pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while group_processes(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
