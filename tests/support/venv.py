"""The cached venvs that run NeMo Gym's servers: build, lock, version, example rows.

Each NeMo Gym version (tests/support/versions.py: 0.7.0 by default, or 0.4.0) runs from its own
venv, built once (about 3 minutes and 1.5 GB) and then reused from
<cache>/nemo-gym-<version>-py3.<minor>. Nothing here lets uv download a Python: uv is not used.
Environment: NEMO_GYM_VERSION (which version), NEMO_GYM_PYTHON (interpreter to build with),
NEMO_GYM_VENV (a venv to use instead of the cache; one the harness did not build is used as it
is if it imports nemo_gym, and never deleted). Built with pip constraints: `locks.py`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tests.support import locks
from tests.support.errors import NemoGymError
from tests.support.procs import tail
from tests.support.versions import (
    DEFAULT_VERSION,
    PythonChoice,
    choose_python,
    python_version,
    spec,
)

# The version env NEMO_GYM_VERSION chose at import (for reports); functions take version=.
NEMO_GYM_VERSION = os.environ.get("NEMO_GYM_VERSION") or DEFAULT_VERSION
MARKER_NAME = ".complete"
PROGRESS_EVERY = 15.0  # seconds between progress lines while pip runs or a lock is awaited

_forbidden: str | None = None


def forbid_nemo_gym(reason: str | None) -> None:
    """While `reason` is set, using the NeMo Gym venv raises NemoGymError(reason); the test
    suite sets it for tests not marked `nemo_gym`, so the fast tier provably never builds the
    venv or starts servers. None allows it again."""
    global _forbidden
    _forbidden = reason


def check_allowed() -> None:
    """Raise NemoGymError if forbid_nemo_gym() is in force."""
    if _forbidden:
        raise NemoGymError(_forbidden)


def find_python(version: str | None = None) -> str:
    """The interpreter that builds NeMo Gym `version`'s venv (versions.choose_python)."""
    return choose_python(version).path


def cache_dir() -> Path:
    """The user cache folder for this project ($XDG_CACHE_HOME or ~/.cache, then nemo_gym_grpc)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nemo_gym_grpc"


def default_venv_dir(minor: int, version: str | None = None) -> Path:
    """<cache>/nemo-gym-<version>-py3.<minor> (version None: selected_version())."""
    return cache_dir() / f"nemo-gym-{spec(version).version}-py3.{minor}"


def venv_is_complete(venv: Path) -> bool:
    """The build finished (marker written last) and the venv's interpreter still resolves."""
    python = venv / "bin" / "python"
    return (venv / MARKER_NAME).is_file() and python.exists() and os.access(python, os.X_OK)


def mark_venv_complete(
    venv: Path, version: str, packages: Sequence[str] = (), **facts: object
) -> None:
    """Write the completion marker (atomically): the NeMo Gym `version`, the venv's Python,
    the pip `packages` and any other facts about the build."""
    found = python_version(str(venv / "bin" / "python"))
    info: dict[str, object] = {
        "nemo_gym": version,
        "python": ".".join(map(str, found)) if found else None,
        "packages": list(packages),
    }
    info.update(facts)
    tmp = venv / f"{MARKER_NAME}.tmp"
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.replace(venv / MARKER_NAME)


def venv_version(venv: str | Path) -> str:
    """The NeMo Gym version in `venv`: its marker's, else what the installed nemo-gym
    distribution says. NemoGymError if the venv has neither."""
    venv = Path(venv)
    with contextlib.suppress(OSError, ValueError):
        recorded = json.loads((venv / MARKER_NAME).read_text()).get("nemo_gym")
        if isinstance(recorded, str):
            return recorded
    probe = "import importlib.metadata as m, nemo_gym; print(m.version('nemo-gym'))"
    try:
        out = subprocess.run(
            [str(venv / "bin" / "python"), "-c", probe],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise NemoGymError(f"{venv}/bin/python does not run: {exc}") from None
    if out.returncode != 0:
        raise NemoGymError(f"{venv} cannot import nemo_gym:\n{out.stderr[-2000:]}")
    return out.stdout.strip()


def _check_imports(python: Path, modules: Sequence[str]) -> str | None:
    """None if `import modules` works in that interpreter, else its stderr."""
    if not modules:
        return None
    out = subprocess.run(
        [str(python), "-c", "import " + ", ".join(modules)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    return None if out.returncode == 0 else out.stderr[-3000:]


def _last_line(log: Path) -> str:
    lines = tail(log, 5).splitlines()
    return lines[-1].strip()[:160] if lines else ""


@contextlib.contextmanager
def file_lock(
    path: Path, timeout: float, log: Path | None = None, what: str = "the NeMo Gym venv"
) -> Iterator[None]:
    """An exclusive fcntl.flock on `path`, waiting at most `timeout` seconds (NemoGymError
    after that). While waiting, a line on stderr every PROGRESS_EVERY s (with the last line of
    the other build's `log`); `what` names what the other process is building."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        started = time.monotonic()
        next_report = started
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - started
                if waited > timeout:
                    raise NemoGymError(
                        f"timed out after {timeout:.0f} s waiting for {path} "
                        f"(another process is building {what})"
                    ) from None
                if time.monotonic() >= next_report:
                    last = f": {_last_line(log)}" if log and log.exists() else ""
                    print(
                        f"waiting for {path} (another process is building {what}), "
                        f"{waited:.0f} s so far{last}",
                        file=sys.stderr,
                    )
                    next_report += PROGRESS_EVERY
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_venv(
    venv_dir: str | Path | None = None,
    *,
    version: str | None = None,
    python: str | None = None,
    packages: Sequence[str] | None = None,
    import_check: Sequence[str] | None = None,
    lock_timeout: float = 1800.0,
    build_timeout: float = 1800.0,
    locked: bool = True,
) -> Path:
    """The cached venv that runs NeMo Gym `version`'s servers (None: env NEMO_GYM_VERSION, else
    0.7.0); built on first use. The returned path is absolute.

    Path: `venv_dir`, else env NEMO_GYM_VENV, else <cache>/nemo-gym-<version>-py3.<minor>
    (the first built one of the version's minors, else the minor of the chosen interpreter).
    `packages` / `import_check` default to the version's (versions.SPECS). A harness venv
    counts as built only when its marker file exists; an unmarked `venv_dir` or cache venv is
    deleted and rebuilt. NEMO_GYM_VENV is the user's: without the marker it is used as it is if
    it imports nemo_gym, else NemoGymError; it is never deleted (a missing path is built).
    `locked`: pip constraints from the version's lock file (`locks.py`, rebuilt when it changes).
    An fcntl lock on `<venv>.lock` keeps two processes from building at once. Raises
    NoSuitablePython, or NemoGymError if the build fails or takes over `build_timeout` s, or if
    the venv's NeMo Gym is not the `version` asked for (explicitly or by env).
    """
    wanted = spec(version)
    packages = wanted.packages if packages is None else tuple(packages)
    import_check = wanted.import_check if import_check is None else tuple(import_check)
    if venv_dir is None and packages:
        check_allowed()  # the shared NeMo Gym venv, not a test's own throwaway venv
    asked = version or os.environ.get("NEMO_GYM_VERSION")
    user_venv = os.environ.get("NEMO_GYM_VENV") if venv_dir is None else None
    if user_venv:
        venv_dir = Path(user_venv).absolute()
        if venv_dir.exists() and not venv_is_complete(venv_dir):
            return _check_version(venv_dir, asked, _use_unmarked(venv_dir))
    if venv_dir is None:
        for minor in wanted.minors:  # an already built venv needs no interpreter lookup
            cached = default_venv_dir(minor, wanted.version)
            lock = locks.nemo_gym_lock(wanted.version, minor)
            if venv_is_complete(cached) and locks.built_from(cached / MARKER_NAME, lock):
                return cached.absolute()
    if venv_dir is not None and venv_is_complete(Path(venv_dir)):
        return _check_version(Path(venv_dir).absolute(), asked if user_venv else None)

    choice = _choice(python, wanted.version)
    if venv_dir is None:
        venv_dir = default_venv_dir(choice.version[1], wanted.version)
    venv = Path(venv_dir).absolute()

    lock = locks.nemo_gym_lock(wanted.version, choice.version[1]) if locked and packages else None
    log = venv.with_name(venv.name + ".install.log")
    with file_lock(venv.with_name(venv.name + ".lock"), lock_timeout, log):
        if venv_is_complete(venv) and locks.built_from(venv / MARKER_NAME, lock):  # meanwhile
            return venv
        _build_venv(venv, choice, wanted.version, packages, import_check, build_timeout, lock)
    return venv


def _choice(python: str | None, version: str) -> PythonChoice:
    if python is None:
        return choose_python(version)
    found = python_version(python) or (0, 0, 0)
    return PythonChoice(python, found, found < spec(version).requires_python)


def _use_unmarked(venv: Path) -> str:
    """The NeMo Gym version of a user's venv the harness did not build (said on stderr)."""
    try:
        found = venv_version(venv)
    except NemoGymError as exc:
        raise NemoGymError(
            f"NEMO_GYM_VENV={venv} was not built by the harness (no {MARKER_NAME}) and is not "
            f"usable: {exc}\nThe harness never deletes it: fix it, delete it (it is then built "
            "there) or unset NEMO_GYM_VENV."
        ) from None
    print(f"using NEMO_GYM_VENV={venv} as it is: nemo-gym {found}", file=sys.stderr)
    return found


def _check_version(venv: Path, asked: str | None, found: str | None = None) -> Path:
    found = found or venv_version(venv)
    if asked and found != asked:
        raise NemoGymError(f"{venv} has nemo-gym {found}, but NeMo Gym {asked} was asked for")
    return venv


def _announce(
    venv: Path,
    choice: PythonChoice,
    version: str,
    packages: Sequence[str],
    log: Path,
    lock: Path | None,
) -> None:
    shown = "Python " + ".".join(map(str, choice.version))
    if not packages:
        print(f"building an empty venv {venv} with {shown} ({choice.path})", file=sys.stderr)
        return
    need = spec(version).requires_python
    flag = " --ignore-requires-python" if choice.ignore_requires_python else ""
    print(
        f"Building the NeMo Gym {version} venv {venv} (first use only; later runs reuse it).\n"
        f"  What: pip install{flag} {' '.join(packages)}, with {shown} ({choice.path}), "
        + (f"constrained by {lock.name}.\n" if lock else "unconstrained.\n")
        + f"  Why: the tests, the demo and the benchmarks run real NeMo Gym {version} resources "
        f"servers, which need Python >= {need[0]}.{need[1]} in a venv of their own.\n"
        + (
            f"  Note: nemo-gym {version} declares Requires-Python >= {'.'.join(map(str, need))} "
            f"and no such interpreter was found, so it is installed on {shown} with "
            "--ignore-requires-python (its servers run on it; NEMO_GYM_PYTHON picks another).\n"
            if choice.ignore_requires_python
            else ""
        )
        + f"  Cost: {spec(version).build_cost}.\n"
        f"  Progress below every {PROGRESS_EVERY:.0f} s; full pip log: {log}",
        file=sys.stderr,
    )


def run_step(
    step: list[str],
    out: Any,
    log: Path,
    env: dict[str, str],
    started: float,
    deadline: float,
    what: str = "the NeMo Gym venv",
) -> int:
    """Run one build command of `what` with its output in `log`; print elapsed seconds and
    pip's last log line every PROGRESS_EVERY s. Kills it and raises NemoGymError past
    `deadline`."""
    out.write(f"$ {' '.join(step)}\n")
    out.flush()
    proc = subprocess.Popen(step, stdout=out, stderr=subprocess.STDOUT, env=env)
    while True:
        try:
            return proc.wait(timeout=max(0.1, min(PROGRESS_EVERY, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            elapsed = time.monotonic() - started
            if time.monotonic() >= deadline:
                proc.kill()
                proc.wait(timeout=30)
                raise NemoGymError(
                    f"building {what} took over {elapsed:.0f} s ({' '.join(step)} "
                    f"killed); log {log}:\n{tail(log)}"
                ) from None
            print(f"  {elapsed:4.0f} s  {_last_line(log)}", file=sys.stderr)


def _build_venv(
    venv: Path,
    choice: PythonChoice,
    version: str,
    packages: Sequence[str],
    modules: Sequence[str],
    timeout: float,
    lock: Path | None,
) -> None:
    if venv.exists() or venv.is_symlink():
        print(f"removing NeMo Gym venv {venv} (incomplete or another lock)", file=sys.stderr)
        if venv.is_symlink() or venv.is_file():
            venv.unlink()
        else:
            shutil.rmtree(venv)
    log = venv.with_name(venv.name + ".install.log")
    _announce(venv, choice, version, packages, log, lock)
    env = dict(os.environ, UV_PYTHON_DOWNLOADS="never", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    started = time.monotonic()
    deadline = started + timeout
    venv.parent.mkdir(parents=True, exist_ok=True)
    flags = ["--ignore-requires-python"] if choice.ignore_requires_python else []
    with open(log, "w") as out:
        steps = [[choice.path, "-m", "venv", *([] if packages else ["--without-pip"]), str(venv)]]
        if packages:
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install"]
            steps.append([*pip, *flags, *packages, *(["-c", str(lock)] if lock else [])])
        for step in steps:
            code = run_step(step, out, log, env, started, deadline)
            if code != 0:
                raise NemoGymError(
                    f"building the NeMo Gym venv failed ({' '.join(step)} exited {code}); "
                    f"log {log}:\n{tail(log)}"
                )
    problem = _check_imports(venv / "bin" / "python", modules)
    if problem:
        raise NemoGymError(f"the new NeMo Gym venv {venv} cannot import {modules}:\n{problem}")
    seconds = round(time.monotonic() - started, 1)
    mark_venv_complete(
        venv,
        version,
        packages,
        ignore_requires_python=choice.ignore_requires_python,
        constraints=locks.digest(lock) if lock else None,
        build_seconds=seconds,
        built_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    print(f"built the venv {venv} in {seconds} s", file=sys.stderr)


def site_packages(venv: Path) -> Path:
    """The venv's lib/python3.*/site-packages (NemoGymError if there is none)."""
    found = sorted(Path(venv).glob("lib/python3.*/site-packages"))
    if not found:
        raise NemoGymError(f"no lib/python3.*/site-packages in {venv}")
    return found[-1]


def resources_server_dir(server: str, venv: Path | None = None) -> Path:
    """site-packages/resources_servers/<server> inside the venv (code, configs, example data).
    Raises NemoGymError for an unknown server name."""
    check_allowed()
    folder = site_packages(venv or ensure_venv()) / "resources_servers" / server
    if not (folder / "app.py").is_file():
        raise NemoGymError(f"no NeMo Gym resources server named {server!r} ({folder})")
    return folder


def example_rows(server: str, venv: Path | None = None) -> list[dict[str, Any]]:
    """The rows of the server's shipped data/example.jsonl (fresh dicts on every call)."""
    path = resources_server_dir(server, venv) / "data" / "example.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
