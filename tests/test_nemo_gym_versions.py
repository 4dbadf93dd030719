"""Which NeMo Gym the harness runs and with which Python (tests/support/versions.py): env
NEMO_GYM_VERSION, per-version interpreter rules and the build announcement. No servers; fake
interpreters are shell scripts that print a version, as `python -c` would."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

import pytest

from tests.support import (
    NemoGymError,
    NoSuitablePython,
    find_python,
    locks,
    selected_version,
    versions,
)
from tests.support import venv as support_venv


def _fake_python(folder: Path, version: str, name: str | None = None) -> str:
    """A script that answers every invocation by printing `version` (as `python -c` would)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / (name or f"python{version}")
    script.write_text(f"#!/bin/sh\necho {version}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.parametrize(("version", "minor"), [("0.7.0", 13), ("0.4.0", 12)])
def test_find_python_gives_a_runnable_interpreter_of_the_version(version, minor):
    try:
        python = find_python(version)
    except NoSuitablePython as exc:
        if os.environ.get("CI"):  # CI has both interpreters: a missing one is a failure
            raise
        pytest.skip(str(exc))
    found = versions.python_version(python)
    assert found is not None and found[:2] >= (3, minor)


def test_0_7_prefers_a_real_3_13_14_and_falls_back_to_3_13_with_the_pip_flag(tmp_path, monkeypatch):
    monkeypatch.delenv("NEMO_GYM_PYTHON", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    old = _fake_python(tmp_path / "versions" / "3.13.0" / "bin", "3.13.0", "python")
    assert versions.choose_python("0.7.0") == versions.PythonChoice(old, (3, 13, 0), True)
    new = _fake_python(tmp_path / "versions" / "3.13.20" / "bin", "3.13.20", "python")
    _fake_python(tmp_path / "versions" / "3.12.9" / "bin", "3.12.9", "python")
    assert versions.choose_python("0.7.0") == versions.PythonChoice(new, (3, 13, 20), False)
    assert versions.choose_python("0.4.0").version == (3, 12, 9)  # 0.4 keeps preferring 3.12


def test_the_version_comes_from_nemo_gym_version(monkeypatch):
    monkeypatch.delenv("NEMO_GYM_VERSION", raising=False)
    assert selected_version() == "0.7.0"
    monkeypatch.setenv("NEMO_GYM_VERSION", "0.4.0")
    assert selected_version() == "0.4.0" and versions.spec().packages[0] == "nemo-gym==0.4.0"
    assert support_venv.default_venv_dir(12).name == "nemo-gym-0.4.0-py3.12"
    assert support_venv.default_venv_dir(13, "0.7.0").name == "nemo-gym-0.7.0-py3.13"
    monkeypatch.setenv("NEMO_GYM_VERSION", "0.5.1")
    with pytest.raises(NemoGymError, match=r"0\.5\.1 is not one of 0\.7\.0, 0\.4\.0"):
        selected_version()


def test_find_python_rejects_a_too_old_nemo_gym_python(tmp_path, monkeypatch):
    monkeypatch.setenv("NEMO_GYM_PYTHON", _fake_python(tmp_path, "3.11.9"))
    with pytest.raises(NoSuitablePython, match=r"3\.11.*Install"):
        find_python("0.4.0")
    monkeypatch.setenv("NEMO_GYM_PYTHON", _fake_python(tmp_path, "3.12.1"))
    with pytest.raises(NoSuitablePython, match=r"3\.12.*>= 3\.13"):
        find_python("0.7.0")
    monkeypatch.setenv("NEMO_GYM_PYTHON", _fake_python(tmp_path, "3.13.0"))
    assert versions.choose_python("0.7.0").ignore_requires_python
    monkeypatch.setenv("NEMO_GYM_PYTHON", str(tmp_path / "missing"))
    with pytest.raises(NoSuitablePython, match="does not run"):
        find_python()


def test_a_new_build_says_what_it_builds_and_why(tmp_path, capsys):
    venv = tmp_path / "announced"
    choice = versions.PythonChoice(sys.executable, (3, 12, 1), False)
    lock = locks.nemo_gym_lock("0.4.0", 12)
    assert lock is not None  # the repository's lock file for the 0.4.0 venv
    support_venv._announce(venv, choice, "0.4.0", versions.SPECS["0.4.0"].packages, tmp_path, lock)
    text = capsys.readouterr().err
    assert "pip install nemo-gym==0.4.0" in text and sys.executable in text
    assert "constrained by nemo-gym-0.4.0-py3.12.txt" in text
    assert "Python >= 3.12" in text and "1.5 GB" in text and "every 15 s" in text
    assert "ignore-requires-python" not in text
    choice = versions.PythonChoice(sys.executable, (3, 13, 0), True)
    support_venv._announce(venv, choice, "0.7.0", versions.SPECS["0.7.0"].packages, tmp_path, None)
    text = capsys.readouterr().err
    assert ", unconstrained." in text
    assert "pip install --ignore-requires-python nemo-gym==0.7.0 tiktoken" in text
    assert "declares Requires-Python >= 3.13.14" in text and "Python 3.13.0" in text


def test_a_cached_venv_is_rebuilt_when_its_lock_file_changes(tmp_path):
    lock, marker = tmp_path / "lock.txt", tmp_path / "marker.json"
    lock.write_text("six==1.16.0\n")
    marker.write_text(json.dumps({"constraints": locks.digest(lock)}))
    assert locks.built_from(marker, lock)
    lock.write_text("six==1.17.0\n")
    assert not locks.built_from(marker, lock) and not locks.built_from(marker, None)
    marker.write_text(json.dumps({"nemo_gym": "0.7.0"}))  # built before there were lock files
    assert locks.built_from(marker, None) and not locks.built_from(marker, lock)


def test_every_lock_file_pins_each_package_to_one_version():
    files = sorted(locks.LOCKS.glob("*.txt"))
    assert {f.name for f in files} >= {"dev.txt", "verl.txt", "nemo-gym-0.7.0-py3.13.txt"}
    for lock in files:
        lines = [line for line in lock.read_text().splitlines() if not line.startswith("#")]
        assert lines and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[^\s;]+", x) for x in lines), lock
