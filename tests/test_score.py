"""`nemo-gym-grpc score`: saved rollouts re-verified by the real NeMo Gym mcqa server through a
real bridge (embedded, or a running one reached with --target), run as the installed CLI.

Rows are NeMo Gym's mcqa example rows plus `response`, a real saved Responses object taken
from NeMo Gym's own example_rollouts.jsonl (its nulls included) with the answer text set to a
known letter, and the row's `reward` as the rollout saved it. Where a test must know which rows
reached the server, or hold some of them, the bridge reaches mcqa through a FaultProxy.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gym_grpc.cli import main
from tests.support import DEFAULT_SERVERS, closed_port, example_rows, resources_server_dir
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.nemo_gym, pytest.mark.compat]  # every test reads NeMo Gym rows

HOLD = "HOLD"  # in a response id: the proxy holds that row's /verify (Fault "hang")
SLOW = "SLOW"  # in a response id: the proxy delays that row's /verify (Fault "delay")


def rollout_rows(
    count: int, *, marked: range = range(0), marker: str = HOLD, ref: bool = True
) -> list[dict]:
    """`count` mcqa rollout rows: every third answer wrong, the rest right; `reward` as saved.

    `marked`: 0-based indices of rows whose response id contains `marker`.
    `ref=False`: no `resources_server_ref` (routed by --server).
    """
    rows = example_rows("mcqa")
    path = resources_server_dir("mcqa") / "data" / "example_rollouts.jsonl"
    saved = json.loads(path.read_text().splitlines()[0])
    out = []
    for i in range(count):
        row = copy.deepcopy(rows[i % len(rows)])
        right = i % 3 != 0
        expected = row["expected_answer"]
        letter = expected if right else ("A" if expected != "A" else "C")
        response = copy.deepcopy(saved["response"])
        response["output"][0]["content"][0]["text"] = f"Step by step... \\boxed{{{letter}}}"
        if i in marked:
            response["id"] = f"resp_{marker}_{i}"
        prompt = row["responses_create_params"]["input"]
        params = dict(saved["responses_create_params"], input=prompt)
        row.update(responses_create_params=params, response=response, reward=float(right))
        if ref:
            row["resources_server_ref"] = {"name": "mcqa"}
        out.append(row)
    return out


def write_rows(path: Path, rows: list, *, raw_lines: dict[int, str] | None = None) -> Path:
    """One JSON line per row; `raw_lines` {index: text} puts text lines before row `index`."""
    lines = []
    for i, row in enumerate(rows):
        if raw_lines and i in raw_lines:
            lines.append(raw_lines[i])
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def read_out(path: Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def table_row(summary: str, server: str) -> list[str]:
    """The cells after the server name in the summary table's line for `server`."""
    (line,) = [line for line in summary.splitlines() if line.split()[:1] == [server]]
    return line.split()[1:]


def score_cli(*args: str, env: dict | None = None, timeout: float = 180):
    """Run the installed `nemo-gym-grpc score ...`; returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "nemo_gym_grpc.cli", "score", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def score_example_rollouts(server: str, head_url: str, tmp_path: Path) -> list[dict]:
    """`score` of `server`'s own data/example_rollouts.jsonl through the head server at
    `head_url`: its records, after checking that it exited 0, read every verdict field the
    server sends (no warning) and wrote one record per row."""
    rows = resources_server_dir(server) / "data" / "example_rollouts.jsonl"
    out = tmp_path / "out.jsonl"
    args = [str(rows), "-o", str(out), "--head-url", head_url, "--server", server]
    done = score_cli(*args, "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr
    records = read_out(out)
    assert len(records) == len([line for line in rows.read_text().splitlines() if line])
    return records


@pytest.fixture
def proxied_bridge(nemo_gym, start_bridge):
    """(proxy, bridge): a bridge routing `mcqa` to the real mcqa server through a proxy."""
    with FaultProxy(nemo_gym.server_urls["mcqa"]) as proxy:
        bridge = start_bridge("--server", f"mcqa={proxy.url}", "--verify-timeout", "300")
        yield proxy, bridge


def test_scores_rollouts_through_an_embedded_bridge_in_input_order(nemo_gym, tmp_path):
    rows = rollout_rows(24)
    for row in rows[1::2]:
        del row["resources_server_ref"]  # routed by --server
    rows_path = write_rows(tmp_path / "rows.jsonl", rows, raw_lines={5: ""})  # a blank line
    out = tmp_path / "out.jsonl"
    done = score_cli(
        str(rows_path), "-o", str(out), "--head-url", nemo_gym.head_url, "--server", "mcqa",
        "--batch-size", "4", "--concurrency", "3",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = read_out(out)
    assert [r["line"] for r in records] == [*range(1, 6), *range(7, 26)]  # line 6 is blank
    assert [r["reward"] for r in records] == [r["reward"] for r in rows]  # == saved rewards
    assert [r["previous_reward"] for r in records] == [r["reward"] for r in rows]
    assert all(r["error"] is None and r["resources_server"] == "mcqa" for r in records)
    assert "item/s" in done.stderr  # the progress bar
    mean = sum(r["reward"] for r in rows) / len(rows)
    assert table_row(done.stdout, "mcqa") == ["24", "24", f"{mean:.4f}", "0", "-"]
    assert "24 of 24 rows in" in done.stdout


def test_rows_that_cannot_be_scored_get_their_cause_and_the_rest_is_scored(
    bridge_target, tmp_path, capsys
):
    good = rollout_rows(3)
    unrouted = rollout_rows(1, ref=False)[0]
    no_response = {k: v for k, v in good[1].items() if k != "response"}
    rows = [good[0], unrouted, no_response, ["a", "list"], good[1], good[2]]
    rows_path = write_rows(tmp_path / "rows.jsonl", rows, raw_lines={4: "{not json"})
    out = tmp_path / "out.jsonl"
    status = main(["score", str(rows_path), "-o", str(out), "--target", bridge_target])
    assert status == 0
    records = read_out(out)
    causes = [(r["error"] or {}).get("reason") for r in records]
    assert causes == [
        None,
        "NO_RESOURCES_SERVER",
        "INVALID_ROW",  # no response
        "INVALID_ROW",  # a JSON list
        "INVALID_ROW",  # not JSON
        None,
        None,
    ]
    assert [r["line"] for r in records] == list(range(1, 8))
    assert records[4]["error"]["message"].startswith("line 5: not JSON: ")
    assert [records[i]["reward"] for i in (0, 5, 6)] == [good[0]["reward"], 1.0, 1.0]
    table = capsys.readouterr().out
    assert "INVALID_ARGUMENT (INVALID_ROW) x3" in table
    assert "7 of 7 rows in" in table and "(4 failed)" in table


def test_a_row_whose_server_has_no_route_stops_the_run_and_stays_for_the_rerun(
    bridge_target, tmp_path
):
    # was: written as a finished NOT_FOUND row with exit 0, so a rerun skipped it
    rows = rollout_rows(4)
    rows[2]["resources_server_ref"] = {"name": "no_such_server"}
    rows_path = write_rows(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out.jsonl"
    args = [str(rows_path), "-o", str(out), "--target", bridge_target, "--no-progress"]
    args += ["--batch-size", "1", "--concurrency", "1"]
    for _ in range(2):  # the rerun stops at the same row, adding nothing twice
        done = score_cli(*args)
        assert done.returncode == 1
        assert "NOT_FOUND (UNKNOWN_RESOURCES_SERVER)" in done.stderr
        assert "rerun the same command to continue" in done.stderr
        assert [r["line"] for r in read_out(out)] == [1, 2]


def test_an_unreachable_head_server_exits_1_and_a_rerun_scores_the_rows(nemo_gym, tmp_path):
    # was: every row written as UNAVAILABLE (HEAD_SERVER_UNAVAILABLE) with exit 0
    rows_path = write_rows(tmp_path / "rows.jsonl", rollout_rows(6))
    out = tmp_path / "out.jsonl"
    args = [str(rows_path), "-o", str(out), "--no-progress"]
    done = score_cli(*args, "--head-url", f"http://127.0.0.1:{closed_port()}")
    assert done.returncode == 1
    assert "UNAVAILABLE (HEAD_SERVER_UNAVAILABLE)" in done.stderr
    assert read_out(out) == []
    done = score_cli(*args, "--head-url", nemo_gym.head_url)
    assert done.returncode == 0, done.stderr
    assert [r["line"] for r in read_out(out)] == list(range(1, 7))
    assert all(r["error"] is None for r in read_out(out))


def test_server_name_equals_url_routes_through_an_embedded_bridge(nemo_gym, tmp_path):
    # was: read as a resources server named "mcqa=http://...", so every row failed NOT_FOUND
    rows = rollout_rows(4, ref=False)
    rows_path = write_rows(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out.jsonl"
    server = f"mcqa={nemo_gym.server_urls['mcqa']}"
    done = score_cli(str(rows_path), "-o", str(out), "--server", server, "--no-progress")
    assert done.returncode == 0, done.stderr
    records = read_out(out)
    assert [r["resources_server"] for r in records] == ["mcqa"] * 4
    assert [r["reward"] for r in records] == [r["reward"] for r in rows]


def test_resume_after_a_partial_out_scores_only_the_rest(proxied_bridge, tmp_path):
    proxy, bridge = proxied_bridge
    rows = rollout_rows(20, marked=range(3), marker=SLOW)
    rows_path = write_rows(tmp_path / "rows.jsonl", rows)
    full = tmp_path / "full.jsonl"
    args = ["--target", bridge.target, "--batch-size", "3", "--no-progress"]
    # the first batch is slow: later ones finish first and wait in the reorder buffer
    proxy.set_faults(Fault("delay", match=SLOW, seconds=1.5))
    assert score_cli(str(rows_path), "-o", str(full), *args).returncode == 0
    assert proxy.total == 20
    records = read_out(full)
    assert [r["line"] for r in records] == list(range(1, 21))
    assert [r["reward"] for r in records] == [r["reward"] for r in rows]

    lines = full.read_bytes().splitlines(keepends=True)
    partial = tmp_path / "partial.jsonl"
    partial.write_bytes(b"".join(lines[:7]) + lines[7][:25])  # a crash while writing line 8
    proxy.reset_counters()
    done = score_cli(str(rows_path), "-o", str(partial), *args)
    assert done.returncode == 0, done.stderr
    assert "dropped an incomplete last line (25 bytes)" in done.stderr
    assert proxy.total == 13  # rows 8..20 only
    assert partial.read_bytes() == full.read_bytes()  # same records, input order
    assert "20 of 20 rows in" in done.stdout

    proxy.reset_counters()
    again = score_cli(str(rows_path), "-o", str(partial), *args)
    assert again.returncode == 0 and proxy.total == 0  # nothing left to score
    assert partial.read_bytes() == full.read_bytes()


def test_an_out_file_that_is_not_from_this_input_is_refused(tmp_path):
    rows_path = write_rows(tmp_path / "rows.jsonl", rollout_rows(4))
    foreign = {"line": 1, "row_sha256": "0" * 16, "reward": 1.0, "error": None}
    cases = {
        "other input": (json.dumps(foreign) + "\n", "does not match line 1"),
        "not a record": ("hello\n", "record 1 is not a score record"),
    }
    for text, message in cases.values():
        out = tmp_path / "out.jsonl"
        out.write_text(text)
        done = score_cli(str(rows_path), "-o", str(out), "--target", "127.0.0.1:1")
        assert done.returncode == 1
        assert message in done.stderr
        assert out.read_text() == text  # untouched


def test_sigint_keeps_a_valid_prefix_and_a_rerun_completes(proxied_bridge, tmp_path):
    proxy, bridge = proxied_bridge
    rows = rollout_rows(24, marked=range(12, 24))  # rows 13.. are held by the proxy
    rows_path = write_rows(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out.jsonl"
    proxy.set_faults(Fault("hang", match=HOLD))
    args = [str(rows_path), "-o", str(out), "--target", bridge.target]
    args += ["--batch-size", "4", "--concurrency", "2"]
    command = [sys.executable, "-m", "nemo_gym_grpc.cli", "score", *args]
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err)
    try:
        wait_until(lambda: out.exists() and out.read_bytes().count(b"\n") >= 12, 120, "12 rows")
        wait_until(lambda: proxy.in_flight >= 4, 60, "held rows in flight")
        os.kill(proc.pid, signal.SIGINT)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130
    records = read_out(out)
    assert [r["line"] for r in records] == list(range(1, 13))
    assert [r["reward"] for r in records] == [r["reward"] for r in rows[:12]]
    assert b"12 of 24 rows in" in stdout
    assert "SIGINT: stopping" in (tmp_path / "stderr").read_text()
    wait_until(lambda: proxy.in_flight == 0, 30, "the bridge to cancel the held /verify calls")

    proxy.set_faults()  # nothing held any more
    done = score_cli(*args, "--no-progress")
    assert done.returncode == 0, done.stderr
    assert proxy.total == 12  # only the rows that were not in OUT
    records = read_out(out)
    assert [r["line"] for r in records] == list(range(1, 25))
    assert [r["reward"] for r in records] == [r["reward"] for r in rows]
    assert "24 of 24 rows in" in done.stdout


def test_a_bridge_that_dies_during_the_run_stops_it_at_once(proxied_bridge, tmp_path):
    """Its port then refuses connections: the run stops with exit 1 after the resends (1 s
    and 2 s apart), not after three connect timeouts of 60 s each."""
    proxy, bridge = proxied_bridge
    proxy.set_faults(Fault("hang"))  # every row held until the bridge goes
    rows_path = write_rows(tmp_path / "rows.jsonl", rollout_rows(8))
    command = [sys.executable, "-m", "nemo_gym_grpc.cli", "score", str(rows_path)]
    command += ["-o", str(tmp_path / "out.jsonl"), "--target", bridge.target, "--no-progress"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: proxy.in_flight >= 1, 60, "rows in flight")
        os.kill(bridge.pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, stderr
    assert f"no connection to the bridge at {bridge.target}: it refused the connection" in stderr


# What NeMo Gym's own example_rollouts.jsonl give, on 0.7.0 and 0.4.0. "as saved": every reward
# as the rollout saved it. "scored": every row scored, though not as saved (mcqa's rows lack the
# `options` it reads now; multireward weighs its components otherwise). "422": the rows lack a
# field the server's request model now requires (HTTP 422: a verdict on the row, written).
EXAMPLE_ROLLOUTS = {
    "mcqa": "scored",
    "equivalence_rule": "as saved",
    "example_single_tool_call": "as saved",
    "reasoning_gym": "422",
    "example_session_state_mgmt": "422",
    "example_tool_call_multireward": "scored",
}


@pytest.mark.parametrize("server", DEFAULT_SERVERS)
def test_nemo_gyms_own_example_rollouts_go_without_their_old_verdict(nemo_gym, server, tmp_path):
    # A rollout row carries its old verdict (`reward`, `equivalence_score`, ...); sent back in
    # the /verify body it made every row of equivalence_rule's file HTTP 500 ("got multiple
    # values for keyword argument 'reward'"), written as results with exit 0.
    records = score_example_rollouts(server, nemo_gym.head_url, tmp_path)
    errors = [r["error"] for r in records if r["error"]]
    expected = EXAMPLE_ROLLOUTS[server]
    if expected == "422":
        assert len(errors) == len(records)
        assert all(e["code"] == "INVALID_ARGUMENT" and "HTTP 422" in e["message"] for e in errors)
        return
    assert errors == []
    if expected == "as saved":
        assert [r["reward"] for r in records] == [r["previous_reward"] for r in records]
