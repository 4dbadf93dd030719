"""The cached venv that runs NeMo Gym's servers: interpreter discovery, build, lock, rows.

NeMo Gym 0.4.0 needs Python >= 3.12 while this project supports 3.10+, so its servers run from
a separate venv, built once (about 3 minutes and 1.5 GB) and then reused from
<cache>/nemo-gym-0.4.0-py3.12. Nothing here lets uv download a Python: uv is not used.
Environment: NEMO_GYM_PYTHON (interpreter to build with), NEMO_GYM_VENV (venv path).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tests.support.errors import NemoGymError, NoSuitablePython
from tests.support.procs import tail

NEMO_GYM_VERSION = "0.4.0"
VENV_PACKAGES = (f"nemo-gym=={NEMO_GYM_VERSION}", "reasoning-gym", "math-verify")
VENV_IMPORT_CHECK = ("nemo_gym", "reasoning_gym", "math_verify")
MARKER_NAME = ".complete"
SUPPORTED_MINORS = (12, 13)  # nemo-gym 0.4.0 declares Python >= 3.12; 3.12 is preferred
PROGRESS_EVERY = 15.0  # seconds between progress lines while pip runs or a lock is awaited
BUILD_COST = "about 3 minutes and 1.5 GB of disk on a 2-core machine with a fast PyPI mirror"

INSTALL_HINT = (
    "The real NeMo Gym servers need a Python >= 3.12 interpreter (nemo-gym 0.4.0 requires it). "
    "Install one (e.g. `pyenv install 3.12` or `apt-get install python3.12 python3.12-venv`), "
    "then put `python3.12` on PATH or point NEMO_GYM_PYTHON at it."
)

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
    """<cache>/nemo-gym-0.4.0-py3.<minor>."""
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
        timeout=60,
    ).stdout.strip()
    info: dict[str, object] = {
        "nemo_gym": NEMO_GYM_VERSION,
        "python": version,
        "packages": list(VENV_PACKAGES),
    }
    info.update(facts)
    tmp = venv / f"{MARKER_NAME}.tmp"
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.replace(venv / MARKER_NAME)


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
def _file_lock(path: Path, timeout: float, log: Path | None = None) -> Iterator[None]:
    """An exclusive fcntl.flock on `path`, waiting at most `timeout` seconds (NemoGymError
    after that). While waiting, a line on stderr every PROGRESS_EVERY s (with the last line of
    the other build's `log`)."""
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
                        "(another process is building the NeMo Gym venv)"
                    ) from None
                if time.monotonic() >= next_report:
                    last = f": {_last_line(log)}" if log and log.exists() else ""
                    print(
                        f"waiting for {path} (another process is building the NeMo Gym venv), "
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
    python: str | None = None,
    packages: Sequence[str] = VENV_PACKAGES,
    import_check: Sequence[str] = VENV_IMPORT_CHECK,
    lock_timeout: float = 1800.0,
    build_timeout: float = 1800.0,
) -> Path:
    """The cached venv that runs the NeMo Gym servers; built on first use.

    Path: `venv_dir`, else env NEMO_GYM_VENV, else <cache>/nemo-gym-0.4.0-py3.12 (or -py3.13 if
    only a 3.13 interpreter exists). The venv counts as built only when its marker file exists;
    a venv without one is deleted and rebuilt. An fcntl lock on `<venv>.lock` keeps two
    processes from building at once. The returned path is absolute. Raises NoSuitablePython,
    or NemoGymError if the build fails or takes longer than `build_timeout` seconds.
    """
    if venv_dir is None and packages:
        check_allowed()  # the shared NeMo Gym venv, not a test's own throwaway venv
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

    log = venv.with_name(venv.name + ".install.log")
    with _file_lock(venv.with_name(venv.name + ".lock"), lock_timeout, log):
        if venv_is_complete(venv):  # built by another process while we waited
            return venv
        _build_venv(venv, python, packages, import_check, build_timeout)
    return venv


def _announce(venv: Path, python: str, packages: Sequence[str], log: Path) -> None:
    version = _python_version(python)
    shown = f"Python {version[0]}.{version[1]}" if version else "Python"
    if not packages:
        print(f"building an empty venv {venv} with {shown} ({python})", file=sys.stderr)
        return
    print(
        f"Building the NeMo Gym venv {venv} (first use only; later runs reuse it).\n"
        f"  What: {' '.join(packages)}, with {shown} ({python}).\n"
        f"  Why: the tests, the demo and the benchmarks run real NeMo Gym {NEMO_GYM_VERSION} "
        "resources servers, which need Python >= 3.12 in a venv of their own.\n"
        f"  Cost: {BUILD_COST}.\n"
        f"  Progress below every {PROGRESS_EVERY:.0f} s; full pip log: {log}",
        file=sys.stderr,
    )


def _run_step(
    step: list[str], out: Any, log: Path, env: dict[str, str], started: float, deadline: float
) -> int:
    """Run one build command with its output in `log`; print elapsed seconds and pip's last
    log line every PROGRESS_EVERY s. Kills it and raises NemoGymError past `deadline`."""
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
                    f"building the NeMo Gym venv took over {elapsed:.0f} s ({' '.join(step)} "
                    f"killed); log {log}:\n{tail(log)}"
                ) from None
            print(f"  {elapsed:4.0f} s  {_last_line(log)}", file=sys.stderr)


def _build_venv(
    venv: Path, python: str, packages: Sequence[str], modules: Sequence[str], timeout: float
) -> None:
    if venv.exists() or venv.is_symlink():
        print(f"removing incomplete NeMo Gym venv {venv}", file=sys.stderr)
        if venv.is_symlink() or venv.is_file():
            venv.unlink()
        else:
            shutil.rmtree(venv)
    log = venv.with_name(venv.name + ".install.log")
    _announce(venv, python, packages, log)
    env = dict(os.environ, UV_PYTHON_DOWNLOADS="never", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    started = time.monotonic()
    deadline = started + timeout
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        steps = [[python, "-m", "venv", *([] if packages else ["--without-pip"]), str(venv)]]
        if packages:
            steps.append([str(venv / "bin" / "python"), "-m", "pip", "install", *packages])
        for step in steps:
            code = _run_step(step, out, log, env, started, deadline)
            if code != 0:
                raise NemoGymError(
                    f"building the NeMo Gym venv failed ({' '.join(step)} exited {code}); "
                    f"log {log}:\n{tail(log)}"
                )
    problem = _check_imports(venv / "bin" / "python", modules)
    if problem:
        raise NemoGymError(f"the new NeMo Gym venv {venv} cannot import {modules}:\n{problem}")
    seconds = round(time.monotonic() - started, 1)
    mark_venv_complete(venv, build_seconds=seconds, built_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
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
