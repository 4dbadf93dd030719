"""`nemo-gym-grpc export`: a NeMo Gym dataset JSONL as verl, slime or OpenRLHF training data.

Each output record carries the whole NeMo Gym row and its resources server name where that
stack's adapter reads them (`stacks.SERVER_KEY`, `stacks.ROW_KEY`), the prompt as chat
messages (from the row's `responses_create_params`: `instructions` as a system message, then
each `input` message; a plain-text `input` is one user message) and the row's
`expected_answer` (as text, "" without one) as the stack's label:

- verl (parquet, verl's RLHFDataset columns): `data_source` = server, `prompt` = messages,
  `ability` = "nemo_gym", `reward_model` = {"style": "rule", "ground_truth": answer},
  `extra_info` = {"index", "resources_server", "nemo_gym_row": the row as JSON text}
  (text, so rows of different shapes fit one parquet schema).
- slime (JSONL): `prompt` = messages, `label` = answer,
  `metadata` = {"resources_server", "nemo_gym_row": the row}.
- openrlhf (JSONL): `prompt` = messages,
  `label` = JSON text {"resources_server", "nemo_gym_row": the row}.

The server of a row is its `resources_server_ref.name`, else `--server`. OUT's folder must
exist (as for `score`); an input without rows, and a row without a server or a prompt, are
refused (naming the line) rather than exported as nothing or as an empty prompt. verl's
parquet needs pyarrow (the `[parquet]` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from nemo_gym_grpc.rewards.client import convert
from nemo_gym_grpc.rewards.stacks import ROW_KEY, SERVER_KEY
from nemo_gym_grpc.rewards.tools.scorefile import input_lines

FORMATS = ("verl", "slime", "openrlhf")
ABILITY = "nemo_gym"


def prompt_messages(row: Mapping[str, Any]) -> list[dict[str, str]]:
    """The row's prompt as `{"role", "content"}` messages (text only; see module docstring).
    Input items without a `role` (e.g. earlier function calls) are left out."""
    params = row.get("responses_create_params") or {}
    messages = []
    instructions = params.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    given = params.get("input")
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    for message in given or []:
        if isinstance(message, Mapping) and isinstance(message.get("role"), str):
            text = convert.content_text(message.get("content"))
            messages.append({"role": message["role"], "content": text})
    return messages


def label(row: Mapping[str, Any]) -> str:
    """The row's `expected_answer` as text ("" if it has none; JSON for a non-string)."""
    answer = row.get("expected_answer")
    if answer is None:
        return ""
    return answer if isinstance(answer, str) else json.dumps(answer)


def server_of(row: Mapping[str, Any], default: str | None, line: int) -> str:
    """The row's `resources_server_ref.name`, else `default`.

    Raises:
        ValueError: neither is set (the message names the input `line`).
    """
    ref = row.get("resources_server_ref")
    name = convert.resources_server_name(ref) or default
    if not name:
        raise ValueError(f"line {line}: no resources_server_ref.name; pass --server NAME")
    return name


def verl_record(row: Mapping[str, Any], server: str, index: int) -> dict[str, Any]:
    """One verl parquet record (module docstring)."""
    return {
        "data_source": server,
        "prompt": prompt_messages(row),
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": label(row)},
        "extra_info": {"index": index, SERVER_KEY: server, ROW_KEY: json.dumps(row)},
    }


def slime_record(row: Mapping[str, Any], server: str, index: int) -> dict[str, Any]:
    """One slime JSONL record (module docstring)."""
    return {
        "prompt": prompt_messages(row),
        "label": label(row),
        "metadata": {SERVER_KEY: server, ROW_KEY: dict(row)},
    }


def openrlhf_record(row: Mapping[str, Any], server: str, index: int) -> dict[str, Any]:
    """One OpenRLHF JSONL record (module docstring)."""
    return {
        "prompt": prompt_messages(row),
        "label": json.dumps({SERVER_KEY: server, ROW_KEY: dict(row)}),
    }


RECORDS: dict[str, Callable[[Mapping[str, Any], str, int], dict[str, Any]]] = {
    "verl": verl_record,
    "slime": slime_record,
    "openrlhf": openrlhf_record,
}


def read_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) for each non-blank line of a NeMo Gym JSONL file.

    Raises:
        ValueError: a line is not a JSON object ("line N: ...").
        OSError: the file cannot be read.
    """
    for number, raw in input_lines(path):
        yield number, convert.json_object(raw, f"line {number}")


def export_rows(
    rows: Iterable[tuple[int, Mapping[str, Any]]], fmt: str, server: str | None
) -> list[dict[str, Any]]:
    """The `fmt` records of `rows` ((line, row) pairs), in order; `index` counts from 0.

    Raises:
        ValueError: unknown `fmt`; a row without a server and no `server` default, or
            without a prompt (no `responses_create_params` with input messages): the
            message names its line ("line N: ...").
    """
    if fmt not in RECORDS:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    make = RECORDS[fmt]
    records = []
    for index, (line, row) in enumerate(rows):
        name = server_of(row, server, line)
        if not prompt_messages(row):
            raise ValueError(
                f"line {line}: no prompt (responses_create_params with `input` messages or "
                "`instructions`); a stack would train on an empty prompt"
            )
        records.append(make(row, name, index))
    return records


def write_records(records: list[dict[str, Any]], path: Path, fmt: str) -> None:
    """Write verl records as parquet (needs pyarrow: the `parquet` extra; verl installs it
    too), others as JSONL, replacing the file at `path`.

    Raises:
        RuntimeError: verl format without pyarrow installed.
        OSError: `path` cannot be written (its folder is not created).
    """
    if fmt == "verl":
        try:
            import pyarrow as pa  # type: ignore[import-untyped]
            import pyarrow.parquet as pq  # type: ignore[import-untyped]
        except ImportError:
            raise RuntimeError(
                "--format verl writes parquet, which needs pyarrow, the [parquet] extra: "
                "pip install '.[parquet]' in a clone of nemo-gym-grpc"
            ) from None
        pq.write_table(pa.Table.from_pylist(records), path)
        return
    with path.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")


def run_export(args: argparse.Namespace) -> int:
    """Run `nemo-gym-grpc export` (`args`: rows, output (Paths, OUT checked writable), format,
    server). Returns 0; 1 with one line on stderr for unreadable input or a row that cannot
    be exported (its line named); 2 with one line for an input without rows. Nothing is
    written unless it returns 0."""
    try:
        records = export_rows(read_rows(args.rows), args.format, args.server)
        if not records:
            print(
                f"nemo-gym-grpc export: error: {args.rows} holds no rows (empty or blank lines)",
                file=sys.stderr,
            )
            return 2
        write_records(records, args.output, args.format)
    except ValueError as exc:
        print(f"nemo-gym-grpc export: {args.rows}: {exc}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError) as exc:
        print(f"nemo-gym-grpc export: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(records)} {args.format} records to {args.output}", file=sys.stderr)
    return 0
