"""Run real NVIDIA NeMo Gym resources servers (and our gRPC bridge) for tests, demos, benchmarks.

NeMo Gym 0.4.0 needs Python >= 3.12, while this project supports 3.10+, so the servers run from a
separate cached venv (built on first use, about 2-3 minutes and 1.5 GB):

    ensure_venv()               -> Path of the venv with nemo-gym==0.4.0, reasoning-gym, math-verify
    example_rows("mcqa")        -> the rows of that server's shipped data/example.jsonl
    with NemoGymServers(("mcqa",)) as gym:   # NeMo Gym's own `ng_run`: Ray + head + servers
        gym.head_url, gym.server_urls["mcqa"]
    with start_bridge("--head-url", gym.head_url) as bridge:
        bridge.target           -> "127.0.0.1:PORT" of `python -m nemo_gym_grpc.bridge serve`

Command line (CI builds the venv up front so its cost shows as its own step):

    python tests/nemo_gym_servers.py ensure-venv
    python tests/nemo_gym_servers.py run [SERVER ...]   # start servers, print URLs, Ctrl-C stops

Environment: NEMO_GYM_PYTHON (interpreter to build the venv with), NEMO_GYM_VENV (venv path),
NEMO_GYM_KEEP_WORKDIR=1 (keep a stack's working dir with its ng_run.log after stop).
Nothing here ever lets uv download a Python: uv is not used, and ng_run gets
UV_PYTHON_DOWNLOADS=never. Linux/POSIX only (process groups, fcntl, /proc).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import requests
import yaml

NEMO_GYM_VERSION = "0.4.0"
VENV_PACKAGES = (f"nemo-gym=={NEMO_GYM_VERSION}", "reasoning-gym", "math-verify")
VENV_IMPORT_CHECK = ("nemo_gym", "reasoning_gym", "math_verify")
MARKER_NAME = ".complete"
DEFAULT_SERVERS = (
    "mcqa",
    "equivalence_rule",
    "example_single_tool_call",
    "reasoning_gym",
    "example_session_state_mgmt",
    "example_tool_call_multireward",
)
NG_RUN_LOG_GRACE = 10.0  # seconds to wait for ng_run's own "servers ready" line
SUPPORTED_MINORS = (12, 13)  # nemo-gym 0.4.0 declares Python >= 3.12; 3.12 is preferred

INSTALL_HINT = (
    "The real NeMo Gym servers need a Python >= 3.12 interpreter (nemo-gym 0.4.0 requires it). "
    "Install one (e.g. `pyenv install 3.12` or `apt-get install python3.12 python3.12-venv`), "
    "then put `python3.12` on PATH or point NEMO_GYM_PYTHON at it."
)


class NoSuitablePython(RuntimeError):
    """No Python >= 3.12 interpreter was found to build the NeMo Gym venv with."""


class NemoGymError(RuntimeError):
    """The NeMo Gym venv could not be built or the servers did not start."""


# --------------------------------------------------------------------------------------------
# Interpreter and venv


def _python_version(executable: str) -> tuple[int, int] | None:
    """(major, minor) reported by running the interpreter, or None if it does not run."""
    try:
        out = subprocess.run(
            [executable, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.fullmatch(r"(\d+)\.(\d+)", out.stdout.strip())
    if out.returncode != 0 or not match:
        return None  # e.g. a pyenv shim for a version that is not selected
    return int(match.group(1)), int(match.group(2))


def _pyenv_candidates(minor: int) -> list[str]:
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")

    def key(path: Path) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", path.name))

    folders = sorted((root / "versions").glob(f"3.{minor}*"), key=key, reverse=True)
    return [
        str(f / "bin" / "python") for f in folders if re.fullmatch(rf"3\.{minor}(\.\d+)?", f.name)
    ]


def find_python() -> str:
    """A Python >= 3.12 interpreter, verified by running it.

    Order: env NEMO_GYM_PYTHON (must work if set), then 3.12 (`python3.12` on PATH, pyenv's
    versions/3.12*), then 3.13 the same way. Raises NoSuitablePython saying what to install.
    """
    explicit = os.environ.get("NEMO_GYM_PYTHON")
    if explicit:
        version = _python_version(explicit)
        if version is None or version < (3, 12):
            found = "does not run" if version is None else f"is Python {version[0]}.{version[1]}"
            raise NoSuitablePython(f"NEMO_GYM_PYTHON={explicit} {found}. {INSTALL_HINT}")
        return explicit
    tried = []
    for minor in SUPPORTED_MINORS:
        on_path = shutil.which(f"python3.{minor}")
        for candidate in ([on_path] if on_path else []) + _pyenv_candidates(minor):
            tried.append(candidate)
            if _python_version(candidate) == (3, minor):
                return candidate
    detail = f" (tried: {', '.join(tried)})" if tried else ""
    raise NoSuitablePython(f"No Python >= 3.12 found{detail}. {INSTALL_HINT}")


def cache_dir() -> Path:
    """The user cache folder for this project ($XDG_CACHE_HOME or ~/.cache, then nemo_gym_grpc)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nemo_gym_grpc"


def default_venv_dir(minor: int = 12) -> Path:
    return cache_dir() / f"nemo-gym-{NEMO_GYM_VERSION}-py3.{minor}"


def venv_is_complete(venv: Path) -> bool:
    """The build finished (marker written last) and the venv's interpreter still resolves."""
    python = venv / "bin" / "python"
    return (venv / MARKER_NAME).is_file() and python.exists() and os.access(python, os.X_OK)


def mark_venv_complete(venv: Path, **facts: object) -> None:
    """Write the completion marker (atomically) with a few facts about the build."""
    python = venv / "bin" / "python"
    version = subprocess.run(
        [str(python), "-c", "import sys; print(sys.version.split()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    info = {"nemo_gym": NEMO_GYM_VERSION, "python": version, "packages": list(VENV_PACKAGES)}
    info.update(facts)
    tmp = venv / f"{MARKER_NAME}.tmp"
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.replace(venv / MARKER_NAME)


def _tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


def _check_imports(python: Path, modules: Sequence[str]) -> str | None:
    """None if `import modules` works in that interpreter, else its stderr."""
    if not modules:
        return None
    out = subprocess.run(
        [str(python), "-c", "import " + ", ".join(modules)],
        capture_output=True,
        text=True,
        check=False,
    )
    return None if out.returncode == 0 else out.stderr[-3000:]


@contextlib.contextmanager
def _file_lock(path: Path, timeout: float):
    """An exclusive fcntl.flock on `path`, waiting at most `timeout` seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        deadline = time.monotonic() + timeout
        announced = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise NemoGymError(
                        f"timed out after {timeout:.0f} s waiting for {path} "
                        "(another process is building the NeMo Gym venv)"
                    ) from None
                if not announced:
                    print(f"waiting for {path} (another build is running)", file=sys.stderr)
                    announced = True
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_venv(
    venv_dir: str | Path | None = None,
    *,
    python: str | None = None,
    packages: Sequence[str] = VENV_PACKAGES,
    import_check: Sequence[str] = VENV_IMPORT_CHECK,
    lock_timeout: float = 1800.0,
) -> Path:
    """The cached venv that runs the NeMo Gym servers; built on first use.

    Path: `venv_dir`, else env NEMO_GYM_VENV, else <cache>/nemo-gym-0.4.0-py3.12 (or -py3.13 if
    only a 3.13 interpreter exists). The venv counts as built only when its marker file exists;
    a venv without one is deleted and rebuilt. An fcntl lock on `<venv>.lock` keeps two
    processes from building at once. The returned path is absolute.
    """
    if venv_dir is None and os.environ.get("NEMO_GYM_VENV"):
        venv_dir = os.environ["NEMO_GYM_VENV"]
    if venv_dir is None:
        for minor in SUPPORTED_MINORS:  # an already built venv needs no interpreter lookup
            if venv_is_complete(default_venv_dir(minor)):
                return default_venv_dir(minor).absolute()
    if venv_dir is not None and venv_is_complete(Path(venv_dir)):
        return Path(venv_dir).absolute()

    python = python or find_python()
    if venv_dir is None:
        version = _python_version(python)
        venv_dir = default_venv_dir(version[1] if version else 12)
    venv = Path(venv_dir).absolute()

    with _file_lock(venv.with_name(venv.name + ".lock"), lock_timeout):
        if venv_is_complete(venv):  # built by another process while we waited
            return venv
        _build_venv(venv, python, packages, import_check)
    return venv


def _build_venv(venv: Path, python: str, packages: Sequence[str], modules: Sequence[str]) -> None:
    if venv.exists() or venv.is_symlink():
        print(f"removing incomplete NeMo Gym venv {venv}", file=sys.stderr)
        if venv.is_symlink() or venv.is_file():
            venv.unlink()
        else:
            shutil.rmtree(venv)
    log = venv.with_name(venv.name + ".install.log")
    print(
        f"building the NeMo Gym venv {venv} with {python} "
        f"({' '.join(packages) or 'no packages'}; log: {log})",
        file=sys.stderr,
    )
    env = dict(os.environ, UV_PYTHON_DOWNLOADS="never", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    started = time.monotonic()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        steps = [[python, "-m", "venv", *([] if packages else ["--without-pip"]), str(venv)]]
        if packages:
            steps.append([str(venv / "bin" / "python"), "-m", "pip", "install", *packages])
        for step in steps:
            out.write(f"$ {' '.join(step)}\n")
            out.flush()
            code = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
            if code != 0:
                raise NemoGymError(
                    f"building the NeMo Gym venv failed ({' '.join(step)} exited {code}); "
                    f"log {log}:\n{_tail(log)}"
                )
    problem = _check_imports(venv / "bin" / "python", modules)
    if problem:
        raise NemoGymError(f"the new NeMo Gym venv {venv} cannot import {modules}:\n{problem}")
    seconds = round(time.monotonic() - started, 1)
    mark_venv_complete(venv, build_seconds=seconds, built_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    print(f"built the NeMo Gym venv in {seconds} s", file=sys.stderr)


def site_packages(venv: Path) -> Path:
    found = sorted(Path(venv).glob("lib/python3.*/site-packages"))
    if not found:
        raise NemoGymError(f"no lib/python3.*/site-packages in {venv}")
    return found[-1]


def resources_server_dir(server: str, venv: Path | None = None) -> Path:
    """site-packages/resources_servers/<server> inside the venv (code, configs, example data)."""
    folder = site_packages(venv or ensure_venv()) / "resources_servers" / server
    if not (folder / "app.py").is_file():
        raise NemoGymError(f"no NeMo Gym resources server named {server!r} ({folder})")
    return folder


def example_rows(server: str, venv: Path | None = None) -> list[dict]:
    """The rows of the server's shipped data/example.jsonl (fresh dicts on every call)."""
    path = resources_server_dir(server, venv) / "data" / "example.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------------------------
# Processes and ports


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    pgid: int
    sid: int
    state: str
    cmdline: str


def list_processes() -> list[ProcInfo]:
    """Every process visible in /proc (pid, process group, session, state, command line)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        # the command name (field 2) is in parentheses and may hold spaces or ')'
        fields = stat[stat.rindex(")") + 2 :].split()
        cmd = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        found.append(ProcInfo(int(entry), int(fields[2]), int(fields[3]), fields[0], cmd or name))
    return found


def group_processes(leader_pid: int, include_zombies: bool = False) -> list[ProcInfo]:
    """Processes in the process group or session that `leader_pid` started (its descendants
    unless they left both), excluding zombies unless asked."""
    return [
        p
        for p in list_processes()
        if (p.pgid == leader_pid or p.sid == leader_pid) and (include_zombies or p.state != "Z")
    ]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def closed_port() -> int:
    """A loopback TCP port nothing listens on (bound once, then released): connecting to it
    is refused, like an upstream that is down."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback TCP ports.

    Chosen outside the kernel's ephemeral range (outgoing connections of Ray and friends take
    ports from it while the servers start) and above Ray's default worker ports (10002-19999)
    and NeMo Gym's own port range (10001-20000), then checked by binding them.
    """
    low, high = 20001, _ephemeral_range()[0] - 1
    if high - low < 1000:  # unusual ephemeral range: let the kernel choose
        low = high = 0
    ports: list[int] = []
    sockets = []
    try:
        for _ in range(2000):
            if len(ports) == count:
                return ports
            port = random.randint(low, high) if high else 0
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            port = sock.getsockname()[1]
            if port in ports:
                sock.close()
                continue
            sockets.append(sock)
            ports.append(port)
    finally:
        for sock in sockets:
            sock.close()
    if len(ports) == count:
        return ports
    raise NemoGymError(f"could not find {count} free loopback ports")


def _default_sigint_in_child() -> None:
    """preexec_fn: the child gets the default SIGINT action (a shell's `cmd &` ignores it, and
    Python keeps an inherited SIG_IGN, so ng_run would never see Ctrl-C) and SIGINT unblocked."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


_live: set = set()  # started stacks and bridges, stopped at interpreter exit if still running


@atexit.register
def _stop_everything_left() -> None:
    for item in list(_live):
        with contextlib.suppress(Exception):
            item.stop()


# --------------------------------------------------------------------------------------------
# NeMo Gym servers via ng_run


def stock_server_config(server: str, venv: Path | None = None) -> dict:
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


def offline_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for ng_run and its servers: no downloads, no telemetry, unbuffered logs."""
    env = dict(os.environ if base is None else base)
    for key in ("RAY_ADDRESS", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTEST_CURRENT_TEST"):
        env.pop(key, None)
    env.update(
        UV_PYTHON_DOWNLOADS="never",  # ng_run would otherwise let uv fetch a Python
        UV_OFFLINE="1",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_USAGE_STATS_PROMPT_ENABLED="0",
        RAY_DISABLE_IMPORT_WARNING="1",
        WANDB_MODE="disabled",
        WANDB_SILENT="true",
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        NO_COLOR="1",
        TERM="dumb",
    )
    return env


class NemoGymServers:
    """NeMo Gym's own launcher (`ng_run`) running the given resources servers on loopback.

    ng_run starts a local Ray cluster, the head server and one process per resources server; all
    of them stay in one new process group/session led by ng_run (pid recorded), which `stop()`
    ends (SIGINT, then SIGKILL). Use as a context manager or call start()/stop().
    """

    def __init__(
        self,
        servers: Iterable[str] = DEFAULT_SERVERS,
        *,
        venv: str | Path | None = None,
        startup_timeout: float = 180.0,
        stop_timeout: float = 20.0,
        config_overrides: Mapping[str, Mapping] | None = None,
        keep_workdir: bool | None = None,
    ) -> None:
        self.servers = tuple(servers)
        if not self.servers or len(set(self.servers)) != len(self.servers):
            raise ValueError(f"need distinct server names, got {self.servers}")
        self.venv = Path(venv) if venv else None
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.config_overrides = {k: dict(v) for k, v in (config_overrides or {}).items()}
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
        self._proc: subprocess.Popen | None = None
        self._log_file = None

    # context manager -------------------------------------------------------------------------
    def __enter__(self) -> NemoGymServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid} head={self.head_url}" if self._proc else "stopped"
        return f"NemoGymServers({self.servers}, {state})"

    # start -----------------------------------------------------------------------------------
    def build_config(self, head_port: int, ports: Mapping[str, int], venv: Path) -> dict:
        """The resources-servers-only ng_run config (no agents, no model servers)."""
        config: dict = {}
        for name in self.servers:
            block = stock_server_config(name, venv)
            block.update(entrypoint=block.get("entrypoint") or "app.py")
            block.setdefault("domain", "other")  # required for resources servers
            block.update(host="127.0.0.1", port=ports[name], verified=False)
            block.update(self.config_overrides.get(name, {}))
            config[name] = {"resources_servers": {name: block}}
        config["head_server"] = {"host": "127.0.0.1", "port": head_port}
        return config

    def start(self) -> NemoGymServers:
        if self._proc is not None:
            raise NemoGymError("already started")
        venv = Path(self.venv or ensure_venv()).absolute()
        for name in self.servers:
            resources_server_dir(name, venv)  # fail early on unknown names
        ports = free_ports(len(self.servers) + 1)
        head_port, server_ports = ports[0], dict(zip(self.servers, ports[1:], strict=True))

        self.workdir = Path(tempfile.mkdtemp(prefix="nemo_gym_"))
        self.config_path = self.workdir / "nemo_gym_servers.yaml"
        self.config_path.write_text(
            yaml.safe_dump(self.build_config(head_port, server_ports, venv), sort_keys=False)
        )
        # ng_run's per-server venv is <cwd>/resources_servers/<name>/.venv (its uv_venv_dir
        # default is the cwd for a wheel install); with +skip_venv_if_present=true it only
        # sources that venv's bin/activate instead of building one with uv.
        for name in self.servers:
            link = self.workdir / "resources_servers" / name / ".venv"
            link.parent.mkdir(parents=True)
            link.symlink_to(venv, target_is_directory=True)

        env = offline_env()
        env["RAY_TMPDIR"] = str(self.workdir / "ray")  # this stack's own Ray session files
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        command = [
            str(venv / "bin" / "ng_run"),
            f"+config_paths=[{self.config_path}]",
            "+skip_venv_if_present=true",
        ]
        self.log_path = self.workdir / "ng_run.log"
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        started = time.monotonic()
        self._proc = subprocess.Popen(
            command,
            cwd=self.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own session + process group, pgid == pid
            preexec_fn=_default_sigint_in_child,
        )
        self.pid = self._proc.pid
        _live.add(self)
        self.head_url = f"http://127.0.0.1:{head_port}"
        self.server_urls = {n: f"http://127.0.0.1:{p}" for n, p in server_ports.items()}
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
        That log output is awaited at most NG_RUN_LOG_GRACE s after the HTTP checks pass."""
        pending = {"head": self.head_url, **self.server_urls}
        deadline = started + self.startup_timeout
        http_ready_at: float | None = None
        with requests.Session() as http:
            http.trust_env = False  # loopback: never through an HTTP(S)_PROXY
            while True:
                if self._proc.poll() is not None:
                    raise NemoGymError(
                        f"ng_run exited with {self._proc.returncode} before the servers were "
                        f"ready ({self._where()}); log tail:\n{self.log_tail()}"
                    )
                for name, url in list(pending.items()):
                    with contextlib.suppress(requests.RequestException, ValueError):
                        if http.get(f"{url}/", timeout=2).json() == {"status": "ok"}:
                            del pending[name]
                if not pending:
                    http_ready_at = http_ready_at or time.monotonic()
                    if self._ng_run_reports_ready():
                        return
                    if time.monotonic() > http_ready_at + NG_RUN_LOG_GRACE:
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
        return _tail(self.log_path, lines) if self.log_path else "(not started)"

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
        _live.discard(self)
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


# --------------------------------------------------------------------------------------------
# The gRPC bridge as a subprocess


class BridgeProcess:
    """A running `python -m nemo_gym_grpc.bridge serve` (see start_bridge)."""

    def __init__(self, proc: subprocess.Popen, target: str, tmpdir: Path, args: Sequence[str]):
        self.proc = proc
        self.pid = proc.pid
        self.target = target
        self.args = tuple(args)
        self.tmpdir = tmpdir
        self.stdout_path = tmpdir / "stdout.log"
        self.stderr_path = tmpdir / "stderr.log"
        self.returncode: int | None = None

    def __enter__(self) -> BridgeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"BridgeProcess(pid={self.pid}, target={self.target!r})"

    def stderr_tail(self, lines: int = 40) -> str:
        return _tail(self.stderr_path, lines)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (graceful), wait up to `timeout`, then SIGKILL. Returns the exit code."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.returncode = self.proc.returncode
        _live.discard(self)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        return self.returncode


def start_bridge(
    *args: str,
    env: Mapping[str, str | None] | None = None,
    timeout: float = 30.0,
    listen: str = "127.0.0.1:0",
) -> BridgeProcess:
    """Start `sys.executable -m nemo_gym_grpc.bridge serve --listen 127.0.0.1:0 --ready-file F
    *args` and wait (at most `timeout` s) until it wrote "host:port" to F.

    `env` entries are laid over os.environ (a None value removes the variable). Raises
    NemoGymError with the bridge's stderr tail if it exits first or does not get ready.
    """
    tmpdir = Path(tempfile.mkdtemp(prefix="nemo_gym_grpc_bridge_"))
    ready = tmpdir / "ready"
    full_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    command = [sys.executable, "-m", "nemo_gym_grpc.bridge", "serve", "--listen", listen]
    command += ["--ready-file", str(ready), *args]
    with open(tmpdir / "stdout.log", "wb") as out, open(tmpdir / "stderr.log", "wb") as err:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=full_env
        )
    bridge = BridgeProcess(proc, "", tmpdir, args)
    _live.add(bridge)
    deadline = time.monotonic() + timeout
    while True:
        text = ready.read_text() if ready.exists() else ""
        if text.endswith("\n") and text.strip():
            bridge.target = text.strip()
            return bridge
        if proc.poll() is not None:
            tail = bridge.stderr_tail()
            bridge.stop()
            raise NemoGymError(
                f"the bridge exited with {proc.returncode} before it was ready "
                f"({' '.join(command)}); stderr tail:\n{tail}"
            )
        if time.monotonic() > deadline:
            tail = bridge.stderr_tail()
            bridge.stop()
            raise NemoGymError(
                f"the bridge wrote no ready file within {timeout:.0f} s ({' '.join(command)}); "
                f"stderr tail:\n{tail}"
            )
        time.sleep(0.05)


# --------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("ensure-venv", help="build (or find) the cached NeMo Gym venv")
    commands.add_parser("find-python", help="print the Python >= 3.12 used to build the venv")
    run = commands.add_parser(
        "run", help="start servers, print their URLs; Ctrl-C or SIGTERM stops them"
    )
    run.add_argument("servers", nargs="*", default=list(DEFAULT_SERVERS))
    args = parser.parse_args(argv)
    try:
        if args.command == "find-python":
            print(find_python())
        elif args.command == "ensure-venv":
            started = time.monotonic()
            venv = ensure_venv()
            print(f"{venv} ready ({time.monotonic() - started:.1f} s)")
        else:
            # Also when started in the background (`&` leaves SIGINT ignored) or by `kill`.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            with NemoGymServers(args.servers) as gym:
                print(f"head {gym.head_url} (ng_run pid {gym.pid}, up in {gym.startup_seconds} s)")
                for name, url in gym.server_urls.items():
                    print(f"{name} {url}")
                sys.stdout.flush()
                with contextlib.suppress(KeyboardInterrupt):
                    while gym._proc and gym._proc.poll() is None:
                        time.sleep(1)
    except (NoSuitablePython, NemoGymError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
