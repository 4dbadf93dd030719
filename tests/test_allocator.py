"""The bridge process's memory management (`bridge/process/allocator.py`), each in a child
interpreter, so that this one's allocator and collector stay as they are."""

from __future__ import annotations

import json
import subprocess
import sys

from nemo_gym_grpc.bridge.process.allocator import YOUNG_THRESHOLD


def _in_child(code: str) -> object:
    """What `code` (run in a new interpreter) prints as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(done.stdout)


def test_the_collector_runs_its_young_pass_less_often_and_skips_what_existed():
    code = (
        "import gc, json; from nemo_gym_grpc.bridge.process import allocator;"
        "before = gc.get_threshold(); allocator.collect_less();"
        "print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count()]))"
    )
    before, after, frozen = _in_child(code)  # type: ignore[misc]
    assert after == [YOUNG_THRESHOLD, *before[1:]] and YOUNG_THRESHOLD > before[0]
    assert frozen > 1000  # the modules' objects, out of every pass


def test_large_freed_blocks_go_back_to_the_system_on_glibc():
    code = "import json; from nemo_gym_grpc.bridge.process import allocator;"
    assert _in_child(code + "print(json.dumps(allocator.return_large_frees()))") is True
