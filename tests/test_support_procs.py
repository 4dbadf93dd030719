"""The tests' ng_run stack starts NeMo Gym through `procs.with_default_sigint`, so that its
SIGINT stops ng_run even when the test process ignores or blocks SIGINT (a shell's `cmd &`
does the former): checked on a child started by such a process."""

from __future__ import annotations

import subprocess
import sys

from tests.support import procs

# A process that ignores and blocks SIGINT starts argv[1:] and prints the child's output.
PARENT = """
import signal, subprocess, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
print(subprocess.run(sys.argv[1:], capture_output=True, text=True, check=True).stdout, end="")
"""
# The child: whether SIGINT is ignored, and blocked, from /proc (bit 2 of SigIgn / SigBlk).
CHILD = """
import signal
fields = dict(line.split(":\\t") for line in open("/proc/self/status").read().splitlines())
bit = 1 << (signal.SIGINT - 1)
print(bool(int(fields["SigIgn"], 16) & bit), bool(int(fields["SigBlk"], 16) & bit))
"""


def _child_sigint(command: list[str]) -> str:
    return subprocess.run(
        [sys.executable, "-c", PARENT, *command], capture_output=True, text=True, timeout=60
    ).stdout.strip()


def test_plain_child_inherits_ignored_sigint() -> None:
    assert _child_sigint([sys.executable, "-c", CHILD]) == "True True"


def test_launched_child_has_default_sigint() -> None:
    assert _child_sigint(procs.with_default_sigint([sys.executable, "-c", CHILD])) == "False False"
