"""The bridge raises its open-files limit at start to what `--max-in-flight` and
`--max-connections` can use (bridge/process/descriptors.py), up to the hard limit, and warns
when that is not enough. Run in child processes started with small limits, so that this
process's own limits stay as they are."""

from __future__ import annotations

import resource
import subprocess
import sys

CHECK = """
import logging, resource, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from nemo_gym_grpc.bridge.process.descriptors import raise_limit
got = raise_limit(int(sys.argv[1]))
print(got, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def run_with_limits(soft: int, hard: int, wanted: int) -> subprocess.CompletedProcess[str]:
    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return subprocess.run(
        [sys.executable, "-c", CHECK, str(wanted)],
        preexec_fn=limits,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def test_the_soft_limit_is_raised_to_what_the_limits_use():
    done = run_with_limits(1024, 4096, 3000)
    assert done.stdout.split() == ["3000", "3000"] and not done.stderr


def test_never_past_the_hard_limit_and_a_warning_says_what_to_do():
    done = run_with_limits(1024, 2048, 18432)
    assert done.stdout.split() == ["2048", "2048"]
    assert "open-files limit 2048 is under the 18432" in done.stderr
    assert "ulimit -n" in done.stderr


def test_a_higher_limit_is_never_lowered():
    done = run_with_limits(4000, 4096, 100)
    assert done.stdout.split() == ["4000", "4000"] and not done.stderr
