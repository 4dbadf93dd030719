"""Command line: `nemo-gym-grpc serve ...` (also `python -m nemo_gym_grpc.bridge serve ...`),
`nemo-gym-grpc score ...`, `nemo-gym-grpc export ...` and `nemo-gym-grpc openrlhf-rm ...`.

`serve`'s flags are generated from `BridgeConfig`'s fields and `PROCESS_FLAGS`; each falls back
to an environment variable (`flags.py`). `score` runs on the trainer side: its parser lives here,
and `nemo_gym_grpc.rewards` is imported only when `score` runs, so the bridge never loads it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pythonjsonlogger.json import JsonFormatter

from nemo_gym_grpc.bridge.config import BridgeConfig, check_exposure, check_limits
from nemo_gym_grpc.bridge.flags import (
    Flag,
    add_flags,
    log_level,
    non_negative_float,
    positive_float,
    positive_int,
    resolve,
)
from nemo_gym_grpc.bridge.server import run
from nemo_gym_grpc.bridge.workers import run_workers

# Settings of the serve process itself, not of one bridge (so not BridgeConfig fields).
WORKERS = Flag(
    "--workers",
    "bridge processes sharing the port via SO_REUSEPORT, one per core",
    type=positive_int,
    default=1,
    metavar="N",
)
LOG_LEVEL = Flag("--log-level", "logging level", type=log_level, default="INFO", metavar="LEVEL")
LOG_FORMAT = Flag(
    "--log-format",
    "text lines, or one JSON object per line for log collectors",
    default="text",
    choices=("text", "json"),
)
PROCESS_FLAGS = (WORKERS, LOG_LEVEL, LOG_FORMAT)

# Trainer-side environment variables named in `score`'s help. Their home is
# rewards/settings.py (which the bridge must not import); tests/test_cli_args.py pins them.
TARGET_ENV = "NEMO_GYM_GRPC_TARGET"
HEAD_URL_ENV = "NEMO_GYM_HEAD_URL"
BATCH_TIMEOUT_ENV = "NEMO_GYM_GRPC_BATCH_TIMEOUT"
DEFAULT_HEAD_URL = "http://127.0.0.1:11000"

log = logging.getLogger(__name__)


def _add_score_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `score` subcommand; `nemo_gym_grpc.rewards.score.run_score` runs it."""
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
        metavar="NAME",
        help="resources server for rows without resources_server_ref.name",
    )
    where = cmd.add_mutually_exclusive_group()
    where.add_argument(
        "--target",
        help=f"gRPC target of a running bridge (default: env {TARGET_ENV}; "
        "unset = start an embedded bridge)",
    )
    where.add_argument(
        "--head-url",
        help="NeMo Gym head server for an embedded bridge "
        f"(default: env {HEAD_URL_ENV}, else {DEFAULT_HEAD_URL})",
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
        help=f"gRPC deadline of one call in seconds (default: env {BATCH_TIMEOUT_ENV}, else 600)",
    )
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_stack_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`export` (`rewards/export.py`) and `openrlhf-rm` (`rewards/openrlhf.py`): trainer side."""
    cmd = commands.add_parser(
        "export",
        help="write a NeMo Gym dataset JSONL as verl (parquet), slime or OpenRLHF (JSONL) data",
        description="`nemo-gym-grpc export ROWS.jsonl -o OUT --format verl|slime|openrlhf`: "
        "each record carries the NeMo Gym row and its resources server for the adapters in "
        "nemo_gym_grpc.rewards (docs/stacks.md).",
    )
    cmd.add_argument("rows", type=Path, help="input JSONL: NeMo Gym dataset rows")
    cmd.add_argument("-o", "--output", type=Path, required=True, help="output file")
    cmd.add_argument("--format", required=True, choices=("verl", "slime", "openrlhf"))
    cmd.add_argument(
        "--server", metavar="NAME", help="resources server for rows without resources_server_ref"
    )
    rm = commands.add_parser(
        "openrlhf-rm",
        help="serve OpenRLHF's remote reward HTTP contract (--remote_rm_url) through the bridge",
        description="POST /get_reward {query, prompts, labels} -> {rewards, scores, extra_logs}. "
        f"Bridge: env {TARGET_ENV}, else an embedded bridge discovering servers from "
        f"{HEAD_URL_ENV}.",
    )
    rm.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    rm.add_argument("--port", type=positive_int, default=5000, help="listen port (default 5000)")


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `nemo-gym-grpc` parser and its `serve` subparser."""
    parser = argparse.ArgumentParser(prog="nemo-gym-grpc", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser(
        "serve",
        help="run the gRPC bridge in front of NeMo Gym resources servers",
        description="Run the gRPC bridge. Each flag not given falls back to the environment "
        "variable shown, then to its default.",
    )
    add_flags(serve_cmd.add_argument_group("bridge"), BridgeConfig.flags())
    add_flags(serve_cmd.add_argument_group("process"), PROCESS_FLAGS)
    _add_score_command(commands)
    _add_stack_commands(commands)
    return parser, serve_cmd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; for `serve`, every flag not given gets its environment value
    or default (`flags.resolve`).

    Raises:
        SystemExit: 2 (with a one-line message) for a bad flag or environment value, or
            `serve` options that contradict each other (`check_limits`); 0 for `--help`.
    """
    parser, serve_cmd = _parsers()
    args = parser.parse_args(argv)
    if args.command == "serve":
        resolve(serve_cmd, args, [*BridgeConfig.flags(), *PROCESS_FLAGS])
        try:
            check_limits(BridgeConfig.from_args(args))
        except ValueError as exc:
            serve_cmd.error(str(exc))
    return args


def _setup_logging(level: str, form: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if form == "json":
        handler.setFormatter(
            JsonFormatter("%(asctime)s %(levelname)s %(name)s %(process)d %(message)s")
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `nemo-gym-grpc` console script. Returns the exit status: 0 done,
    1 the bridge could not start or failed (one line on stderr), 2 bad arguments; `score`
    returns what `run_score` returns, `export` what `run_export` returns."""
    args = parse_args(argv)
    if args.command == "score":
        from nemo_gym_grpc.rewards.score import run_score  # the trainer side, only for score

        return run_score(args)
    if args.command == "export":
        from nemo_gym_grpc.rewards.export import run_export

        return run_export(args)
    if args.command == "openrlhf-rm":
        from nemo_gym_grpc.rewards.openrlhf import serve

        _setup_logging("INFO", "text")
        return serve(args.host, args.port)
    _setup_logging(args.log_level, args.log_format)
    config = BridgeConfig.from_args(args)
    if args.max_item_mb > args.max_message_mb:
        log.warning(
            "--max-item-mb %s exceeds --max-message-mb %s: items that large cannot arrive",
            args.max_item_mb,
            args.max_message_mb,
        )
    if not config.head_url and not (config.servers or config.agents or config.environment_servers):
        log.warning(
            "no --head-url, --server, --agent or --environment-server: every item will fail "
            "with NOT_FOUND"
        )
    try:
        if args.workers > 1:
            check_exposure(config)  # fail before forking
            check_limits(config)
            return run_workers(config, args.workers)
        run(config)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"nemo-gym-grpc: {exc}", file=sys.stderr)
        return 1
    return 0
