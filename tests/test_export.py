"""`nemo-gym-grpc export`: NeMo Gym rows as verl / slime / OpenRLHF data, and those rows scored
right by each stack's adapter through a real bridge and real NeMo Gym resources servers."""

from __future__ import annotations

import json
import sys

import pytest

from nemo_gym_grpc.cli import main as cli_main
from nemo_gym_grpc.rewards import openrlhf, slime, verl
from nemo_gym_grpc.rewards.tools import export
from tests.stacks_common import SlimeSample, answers, export_examples, read_jsonl
from tests.support.items import mcqa_row

pd = pytest.importorskip("pandas")  # the test-trl group of `make dev` installs it


@pytest.fixture
def mcqa_jsonl(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(mcqa_row()) + "\n\n")
    return path


def test_each_format_carries_the_row_and_its_server_where_the_adapters_read_them(
    mcqa_jsonl, tmp_path
):
    row = mcqa_row()
    prompt = [{"role": "user", "content": row["responses_create_params"]["input"][0]["content"]}]
    out = {fmt: tmp_path / f"out.{fmt}" for fmt in export.FORMATS}
    for fmt, path in out.items():
        assert cli_main(["export", str(mcqa_jsonl), "-o", str(path), "--format", fmt,
                         "--server", "mcqa"]) == 0  # fmt: skip

    (verl_row,) = pd.read_parquet(out["verl"]).to_dict("records")
    assert verl_row["data_source"] == "mcqa"
    assert [dict(m) for m in verl_row["prompt"]] == prompt
    assert verl_row["reward_model"] == {"style": "rule", "ground_truth": row["expected_answer"]}
    assert verl_row["extra_info"]["resources_server"] == "mcqa"
    assert json.loads(verl_row["extra_info"]["nemo_gym_row"]) == row

    (slime_row,) = read_jsonl(out["slime"])
    assert slime_row == {
        "prompt": prompt,
        "label": row["expected_answer"],
        "metadata": {"resources_server": "mcqa", "nemo_gym_row": row},
    }
    (openrlhf_row,) = read_jsonl(out["openrlhf"])
    assert openrlhf_row["prompt"] == prompt
    assert json.loads(openrlhf_row["label"]) == {"resources_server": "mcqa", "nemo_gym_row": row}


def test_a_rows_own_resources_server_ref_wins_and_a_row_without_one_needs_server(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(dict(mcqa_row(), resources_server_ref={"name": "other"})) + "\n")
    out = tmp_path / "out.jsonl"
    assert cli_main(["export", str(rows), "-o", str(out), "--format", "slime",
                     "--server", "mcqa"]) == 0  # fmt: skip
    assert read_jsonl(out)[0]["metadata"]["resources_server"] == "other"

    rows.write_text(json.dumps(mcqa_row()) + "\n")
    with pytest.raises(ValueError, match="line 1: no resources_server_ref.name; pass --server"):
        export.export_rows(export.read_rows(rows), "openrlhf", None)


def test_prompt_messages_take_instructions_text_input_and_content_parts():
    row = {
        "responses_create_params": {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Hi "}, "there"]},
                {"type": "function_call", "name": "f", "arguments": "{}"},  # no role: left out
            ],
        }
    }
    assert export.prompt_messages(row) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    assert export.prompt_messages({"responses_create_params": {"input": "Q?"}}) == [
        {"role": "user", "content": "Q?"}
    ]
    assert export.label({"expected_answer": 6}) == "6" and export.label({}) == ""


def test_unreadable_input_exits_1(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("[1, 2]\n")
    assert cli_main(["export", str(rows), "-o", str(tmp_path / "o"), "--format", "verl"]) == 1
    assert f"nemo-gym-grpc export: {rows}: line 1: a JSON list, not an object" in (
        capsys.readouterr().err
    )


def test_a_row_without_a_prompt_is_refused_with_its_line_number(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    no_params = {k: v for k, v in mcqa_row().items() if k != "responses_create_params"}
    empty_input = dict(mcqa_row(), responses_create_params={"input": []})
    for bad in (no_params, empty_input):
        rows.write_text(json.dumps(mcqa_row()) + "\n\n" + json.dumps(bad) + "\n")
        out = tmp_path / "out.jsonl"
        argv = ["export", str(rows), "-o", str(out), "--format", "slime", "--server", "mcqa"]
        assert cli_main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"nemo-gym-grpc export: {rows}: line 3: no prompt"), err
        assert not out.exists()


def test_verl_parquet_needs_the_parquet_extra_and_says_so(
    mcqa_jsonl, tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if pyarrow were not installed
    out = tmp_path / "out.parquet"
    argv = ["export", str(mcqa_jsonl), "-o", str(out), "--format", "verl", "--server", "mcqa"]
    assert cli_main(argv) == 1
    assert "the [parquet] extra: pip install '.[parquet]' in a clone" in capsys.readouterr().err
    assert not out.exists()


def test_an_output_folder_that_does_not_exist_is_refused_not_created(mcqa_jsonl, tmp_path, capsys):
    out = tmp_path / "missing" / "out.jsonl"
    argv = ["export", str(mcqa_jsonl), "-o", str(out), "--format", "slime", "--server", "mcqa"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"nemo-gym-grpc export: error: -o/--output: cannot create {out}: "
        f"folder {out.parent} does not exist"
    )
    assert not out.parent.exists()
    argv[argv.index("-o") + 1] = str(tmp_path)
    assert cli_main(argv) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_an_input_without_rows_is_refused_and_nothing_is_written(tmp_path, capsys, text):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(text)
    out = tmp_path / "out.jsonl"
    assert cli_main(["export", str(rows), "-o", str(out), "--format", "openrlhf"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"nemo-gym-grpc export: error: {rows} holds no rows (empty or blank lines)"
    )
    assert not out.exists()


@pytest.fixture
def via_bridge(bridge_target, monkeypatch):
    monkeypatch.setenv("NEMO_GYM_GRPC_TARGET", bridge_target)
    monkeypatch.delenv("NEMO_GYM_GRPC_ON_ERROR", raising=False)


async def test_exported_verl_rows_score_1_right_and_0_wrong(via_bridge, nemo_gym_venv, tmp_path):
    for server, path in export_examples(nemo_gym_venv, tmp_path, "verl").items():
        rows = pd.read_parquet(path).to_dict("records")
        for pick, expected in ((0, 1.0), (1, 0.0)):
            results = [
                await verl.compute_score(
                    data_source=r["data_source"],
                    solution_str=answers(server, json.loads(r["extra_info"]["nemo_gym_row"]))[pick],
                    ground_truth=r["reward_model"]["ground_truth"],
                    extra_info=dict(r["extra_info"]),
                )
                for r in rows
            ]
            assert results == [{"score": expected, "scoring_failed": 0.0}] * len(rows), server


async def test_exported_slime_rows_score_1_right_and_0_wrong(via_bridge, nemo_gym_venv, tmp_path):
    for server, path in export_examples(nemo_gym_venv, tmp_path, "slime").items():
        rows = read_jsonl(path)
        for pick, expected in ((0, 1.0), (1, 0.0)):
            samples = [
                SlimeSample(
                    prompt=r["prompt"],
                    response=answers(server, r["metadata"]["nemo_gym_row"])[pick],
                    label=r["label"],
                    metadata=r["metadata"],
                )
                for r in rows
            ]
            assert await slime.group_reward(None, samples) == [expected] * len(rows), server
            assert await slime.reward(None, samples[0]) == expected


def test_exported_openrlhf_rows_score_1_right_and_0_wrong(via_bridge, nemo_gym_venv, tmp_path):
    for server, path in export_examples(nemo_gym_venv, tmp_path, "openrlhf").items():
        rows = read_jsonl(path)
        # OpenRLHF's prompts are the chat-templated prompt text; queries add the response.
        prompts = [f"<|user|>{r['prompt'][-1]['content']}<|assistant|>" for r in rows]
        labels = [r["label"] for r in rows]
        for pick, expected in ((0, 1.0), (1, 0.0)):
            queries = [
                p + answers(server, json.loads(label)["nemo_gym_row"])[pick]
                for p, label in zip(prompts, labels, strict=True)
            ]
            result = openrlhf.reward_func(queries, prompts, labels)
            assert result["rewards"].tolist() == [expected] * len(rows), server
            assert result["extra_logs"]["scoring_failed"].tolist() == [0.0] * len(rows)
