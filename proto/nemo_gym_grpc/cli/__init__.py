"""The `nemo-gym-grpc` console script: `serve` runs the bridge; `score`, `export` and
`openrlhf-rm` run on the trainer side.

    nemo-gym-grpc serve ...                     the bridge (`nemo_gym_grpc.bridge.process.cli`)
    nemo-gym-grpc score ROWS.jsonl -o OUT.jsonl re-verify saved rollouts (`score.py`)
    nemo-gym-grpc export ROWS.jsonl -o OUT ...  verl / slime / OpenRLHF data (`export.py`)
    nemo-gym-grpc openrlhf-rm                   OpenRLHF's remote reward HTTP contract

`serve` is handed to the bridge's own command line before anything of the trainer side loads,
so it runs exactly as `python -m nemo_gym_grpc.bridge serve` does (no gRPC client, no
`GRPC_ENABLE_FORK_SUPPORT`). The other commands' parsers are built here; each command's module
is imported only when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from nemo_gym_grpc.bridge.process import cli as bridge_cli
from nemo_gym_grpc.shared.flags import (
    http_url,
    non_negative_float,
    parse_command,
    positive_float,
    positive_int,
    server_entry,
)

PROG = "nemo-gym-grpc"


def _add_score_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `score` subcommand; `score.run_score` runs it."""
    from nemo_gym_grpc.rewards.client import settings

    cmd = commands.add_parser(
        "score",
        help="score a JSONL file of NeMo Gym rows with saved responses (rollouts)",
        description="`nemo-gym-grpc score ROWS.jsonl -o OUT.jsonl`: re-verify saved rollouts "
        "through the bridge.",
    )
    cmd.add_argument("rows", type=Path, help="input JSONL: NeMo Gym rows with `response`")
    cmd.add_argument(
        "-o", "--output", type=Path, required=True, help="output JSONL (appended; resumable)"
    )
    cmd.add_argument(
        "--server",
        type=_score_server,
        metavar="NAME[=URL]",
        help="resources server for rows without resources_server_ref.name; NAME=URL (as for "
        "serve) also routes NAME to that server through an embedded bridge",
    )
    where = cmd.add_mutually_exclusive_group()
    where.add_argument(
        "--target",
        type=_target,
        help=f"gRPC target of a running bridge (default: env {settings.TARGET_ENV}; "
        "unset = start an embedded bridge)",
    )
    where.add_argument(
        "--head-url",
        type=http_url,
        help="NeMo Gym head server for an embedded bridge "
        f"(default: env {settings.HEAD_URL_ENV}, else {settings.DEFAULT_HEAD_URL})",
    )
    cmd.add_argument(
        "--batch-size", type=positive_int, default=64, help="rows per call (default 64)"
    )
    cmd.add_argument(
        "--concurrency", type=positive_int, default=4, help="calls in flight at once (default 4)"
    )
    cmd.add_argument(
        "--timeout",
        type=non_negative_float,
        default=0.0,
        help="seconds per /verify (default 0 = the bridge's --verify-timeout)",
    )
    cmd.add_argument(
        "--batch-timeout",
        type=positive_float,
        help=f"gRPC deadline of one call in seconds (default: env {settings.BATCH_TIMEOUT_ENV}, "
        f"else {settings.DEFAULT_BATCH_TIMEOUT:g})",
    )
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")


def _target(text: str) -> str:
    """`score --target`: a gRPC target, not a URL (`settings.check_target`)."""
    from nemo_gym_grpc.rewards.client import settings

    try:
        return settings.check_target(text, "--target")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _score_server(text: str) -> tuple[str, str | None]:
    """`score --server`: NAME, or NAME=URL as `serve --server` takes it -> (name, URL or None)."""
    if "=" not in text:
        return text, None
    return server_entry(text)


def output_problem(path: Path) -> str | None:
    """Why the file at `path` cannot be written (appended to, replaced or created; a missing
    folder is not created), or None. `score` and `export` check OUT with it before any work."""
    if path.is_dir():
        return f"{path} is a directory"
    if path.exists():
        return None if os.access(path, os.W_OK) else f"{path} is not writable"
    folder = path.parent
    if not folder.is_dir():
        return f"cannot create {path}: folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot create {path}: folder {folder} is not writable"
    return None


def _add_export_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `export` subcommand; `export.run_export` runs it."""
    from nemo_gym_grpc.rewards.tools.export import FORMATS

    cmd = commands.add_parser(
        "export",
        help="write a NeMo Gym dataset JSONL as verl (parquet), slime or OpenRLHF (JSONL) data",
        description="`nemo-gym-grpc export ROWS.jsonl -o OUT --format verl|slime|openrlhf`: "
        "each record carries the NeMo Gym row and its resources server for the adapters in "
        "nemo_gym_grpc.rewards (docs/stacks.md).",
    )
    cmd.add_argument("rows", type=Path, help="input JSONL: NeMo Gym dataset rows")
    cmd.add_argument("-o", "--output", type=Path, required=True, help="output file")
    cmd.add_argument("--format", required=True, choices=FORMATS)
    cmd.add_argument(
        "--server", metavar="NAME", help="resources server for rows without resources_server_ref"
    )


def _add_openrlhf_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `openrlhf-rm` subcommand; `nemo_gym_grpc.rewards.openrlhf.serve` runs it."""
    from nemo_gym_grpc.rewards.client import settings

    cmd = commands.add_parser(
        "openrlhf-rm",
        help="serve OpenRLHF's remote reward HTTP contract (--remote_rm_url) through the bridge",
        description="POST /get_reward {query, prompts, labels} -> {rewards, scores, extra_logs}. "
        f"Bridge: env {settings.TARGET_ENV}, else an embedded bridge discovering servers from "
        f"{settings.HEAD_URL_ENV}.",
    )
    cmd.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    cmd.add_argument("--port", type=positive_int, default=5000, help="listen port (default 5000)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse a trainer-side command line (`score`, `export`, `openrlhf-rm`; `serve` is listed,
    for `--help`, and parsed by the bridge).

    Raises:
        SystemExit: 2 with a one-line message for bad arguments; 0 for `--help`.
    """
    top = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    commands = top.add_subparsers(dest="command", required=True)
    bridge_cli.add_serve_command(commands)
    _add_score_command(commands)
    _add_export_command(commands)
    _add_openrlhf_command(commands)
    return parse_command(top, commands, argv)


def refusal(args: argparse.Namespace) -> str | None:
    """Why arguments that parsed cannot run, checked before any work: an OUT of `score` or
    `export` that cannot be written, `score --server NAME=URL` with `--target`, a timeout
    variable `score` reads that holds no number of seconds; else None."""
    problem = output_problem(args.output) if args.command in ("score", "export") else None
    if problem:
        return f"-o/--output: {problem}"
    if args.command != "score":
        return None
    if args.server and args.server[1] and args.target:
        return (
            "--server NAME=URL routes NAME through an embedded bridge; --target names a "
            "running one: give --server NAME with --target"
        )
    from nemo_gym_grpc.rewards.client import settings

    try:
        if args.batch_timeout is None:
            settings.batch_timeout()
        settings.connect_timeout()
    except ValueError as exc:  # the message names the variable
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `nemo-gym-grpc` console script (`argv`, default `sys.argv[1:]`).

    Returns the exit status: 2 with one line on stderr for arguments that cannot run
    (`refusal`); else `serve`'s is `nemo_gym_grpc.bridge.process.cli.main`'s, `score`'s
    `run_score`'s, `export`'s `run_export`'s, `openrlhf-rm`'s `openrlhf.serve`'s.

    Raises:
        SystemExit: 2 (with a one-line message) for bad arguments; 0 for `--help`.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        return bridge_cli.main(argv)  # the bridge alone: nothing of the trainer side loads
    args = parse_args(argv)
    problem = refusal(args)
    if problem:
        print(f"{PROG} {args.command}: error: {problem}", file=sys.stderr)
        return 2
    if args.command == "score":
        from nemo_gym_grpc.rewards.tools.score import run_score

        return run_score(args)
    if args.command == "export":
        from nemo_gym_grpc.rewards.tools.export import run_export

        return run_export(args)
    from nemo_gym_grpc.rewards.openrlhf import serve

    bridge_cli.setup_logging("INFO", "text")
    return serve(args.host, args.port)
