"""The 60 s variant of `make soak` (tests/support/soak.py): real mcqa replicas SIGKILLed and
restarted, the bridge SIGTERMed and restarted, streams cancelled, bad items — and nothing lost,
duplicated, misassigned, silently 0.0 or untyped; the bridge's RSS and fds flat."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import soak_report
from tests.support.soak import SoakConfig, run_soak


def test_a_60_s_chaos_soak_loses_nothing(nemo_gym_venv: Path, tmp_path: Path) -> None:
    config = SoakConfig(
        duration=60,
        kill_every=15,
        warmup=8,
        cancel_fraction=0.1,  # 1% of the few streams of 60 s may be none
        min_items=1000,
    )
    summary = run_soak(config, tmp_path)
    (tmp_path / "soak.json").write_text(json.dumps(summary, indent=1))
    failed = [check for check, passed in summary["checks"].items() if not passed]
    assert not failed, soak_report.render(summary)
