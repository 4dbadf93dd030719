"""Command line of the bridge: `python -m nemo_gym_grpc.bridge serve ...`, which the
`nemo-gym-grpc` console script (`nemo_gym_grpc.cli`) runs for `serve`.

`serve`'s flags are generated from `BridgeConfig`'s fields and `PROCESS_FLAGS`; each falls back
to an environment variable (`nemo_gym_grpc.shared.flags`). The trainer-side commands (`score`,
`export`, `openrlhf-rm`) live with the trainer side: this module imports nothing of it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pythonjsonlogger.json import JsonFormatter

from nemo_gym_grpc.bridge.process.checks import check_exposure, check_limits, check_tls
from nemo_gym_grpc.bridge.process.config import BridgeConfig
from nemo_gym_grpc.bridge.process.workers import run_workers
from nemo_gym_grpc.bridge.rpc.server import run
from nemo_gym_grpc.shared.child import arm_parent_death
from nemo_gym_grpc.shared.flags import (
    Flag,
    add_flags,
    log_level,
    parse_command,
    positive_int,
    resolve,
)

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

log = logging.getLogger(__name__)


def add_serve_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the `serve` subcommand (its flags from `BridgeConfig` and `PROCESS_FLAGS`) to
    `commands`; returns its parser. The `nemo-gym-grpc` console script lists it this way."""
    serve_cmd = commands.add_parser(
        "serve",
        help="run the gRPC bridge in front of NeMo Gym resources servers",
        description="Run the gRPC bridge. Each flag not given falls back to the environment "
        "variable shown, then to its default.",
    )
    add_flags(serve_cmd.add_argument_group("bridge"), BridgeConfig.flags())
    add_flags(serve_cmd.add_argument_group("process"), PROCESS_FLAGS)
    return serve_cmd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse `serve ...`; every flag not given gets its environment value or default
    (`flags.resolve`).

    Raises:
        SystemExit: 2 (with a one-line message) for a bad flag or environment value, or
            options that contradict each other (`check_limits`), TLS files that cannot
            serve (`check_tls`); 0 for `--help`.
    """
    parser = argparse.ArgumentParser(prog="nemo-gym-grpc", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = add_serve_command(commands)
    args = parse_command(parser, commands, argv)
    resolve(serve_cmd, args, [*BridgeConfig.flags(), *PROCESS_FLAGS])
    try:
        config = BridgeConfig.from_args(args)
        check_limits(config)
        check_tls(config)
    except ValueError as exc:
        serve_cmd.error(str(exc))
    return args


def setup_logging(level: str, form: str) -> None:
    """Log records at `level` and above to stderr, as text lines or JSON objects (`form`)."""
    handler = logging.StreamHandler(sys.stderr)
    if form == "json":
        handler.setFormatter(
            JsonFormatter("%(asctime)s %(levelname)s %(name)s %(process)d %(message)s")
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


def main(argv: list[str] | None = None) -> int:
    """Run `serve ...` (`argv`, default `sys.argv[1:]`) until SIGTERM/SIGINT. Returns the exit
    status: 0 done, 1 the bridge could not start or failed (one line on stderr); bad
    arguments exit 2 (SystemExit). First arms the parent-death signal its starter asked for
    (`arm_parent_death`: the Ray actor's bridge)."""
    arm_parent_death()
    args = parse_args(argv)
    setup_logging(args.log_level, args.log_format)
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
