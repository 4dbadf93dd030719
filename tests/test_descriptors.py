"""The bridge raises its open-files limit at start to what `--max-in-flight` and
`--max-connections` can use (bridge/process/descriptors.py), up to the hard limit, and warns
when that is not enough. Run in child processes started with small limits, so that this
process's own limits stay as they are."""

from __future__ import annotations

import subprocess
import sys

# The child sets its own limits first (argv: soft, hard, wanted). Set by a `preexec_fn`
# instead, they made `subprocess` fork (not vfork), and gRPC's fork handlers of this process
# (its client turns gRPC's fork support on) then wrote an epoll error into the child's stderr
# before its exec now and then (once: a clean-clone CI run on ffc2530).
CHECK = """
import logging, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from nemo_gym_grpc.bridge.process.descriptors import raise_limit
got = raise_limit(int(sys.argv[3]))
print(got, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def run_with_limits(soft: int, hard: int, wanted: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHECK, str(soft), str(hard), str(wanted)],
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
