"""Command line of the harness (CI builds the venv up front so its cost shows as its own step):

python -m tests.support ensure-venv          # build (or find) the cached NeMo Gym venv
python -m tests.support find-python          # the Python it is built with
python -m tests.support run [SERVER ...]     # start servers, print URLs; Ctrl-C stops
python -m tests.support agents [--policy-delay S] [--tool-turns N]
                                             # the agent stack (agents.py), print URLs; Ctrl-C stops
python -m tests.support ensure-axolotl       # build (or find) the axolotl venv (axolotl_venv.py)
python -m tests.support ensure-skyrl         # build (or find) the skyrl venv (skyrl_venv.py)
python -m tests.support refresh-locks        # write tests/locks/ anew (`make lock`, locks.py)

Each NeMo Gym command takes --version 0.7.0 | 0.4.0 (default: env NEMO_GYM_VERSION, else 0.7.0).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Sequence

from tests.support import (
    DEFAULT_SERVERS,
    SPECS,
    AgentStack,
    Knobs,
    NemoGymError,
    NemoGymServers,
    NoSuitablePython,
    ensure_venv,
    find_python,
    locks,
    venv_version,
)
from tests.support.axolotl_venv import AXOLOTL
from tests.support.skyrl_venv import SKYRL
from tests.support.trainer_venv import ensure as ensure_trainer


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; 0 on success, 1 (with the reason on stderr) if the venv or the
    servers are unavailable."""
    args = command_line().parse_args(argv)
    try:
        if args.command in ("ensure-axolotl", "ensure-skyrl"):
            trainer = AXOLOTL if args.command == "ensure-axolotl" else SKYRL
            started = time.monotonic()
            python = ensure_trainer(trainer)
            seconds = time.monotonic() - started
            print(f"{python} ready: {trainer.name} {trainer.version} ({seconds:.1f} s)")
        elif args.command == "refresh-locks":
            locks.refresh()
        elif args.command == "find-python":
            print(find_python(args.version))
        elif args.command == "ensure-venv":
            started = time.monotonic()
            venv = ensure_venv(version=args.version)
            seconds = time.monotonic() - started
            print(f"{venv} ready: nemo-gym {venv_version(venv)} ({seconds:.1f} s)")
        elif args.command == "agents":
            run_agents(args)
        else:
            run_servers(args)
    except (NoSuitablePython, NemoGymError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def command_line() -> argparse.ArgumentParser:
    """The command line (the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.support",
        description="Run real NeMo Gym resources servers for the tests, the demo, benchmarks.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    ensure = commands.add_parser("ensure-venv", help="build (or find) the cached NeMo Gym venv")
    find = commands.add_parser("find-python", help="print the Python used to build the venv")
    run = commands.add_parser(
        "run", help="start servers, print their URLs; Ctrl-C or SIGTERM stops them"
    )
    agents = commands.add_parser(
        "agents", help="start the agent stack (scripted policy), print URLs; Ctrl-C stops it"
    )
    commands.add_parser("ensure-axolotl", help="build (or find) the cached axolotl venv")
    commands.add_parser("ensure-skyrl", help="build (or find) the cached skyrl venv")
    commands.add_parser("refresh-locks", help="write the test venvs' lock files anew (make lock)")
    agents.add_argument("--policy-delay", type=float, default=0.0, help="s per model call")
    agents.add_argument("--tool-turns", type=int, default=1, help="tool calls per rollout")
    for command in (ensure, find, run, agents):
        command.add_argument("--version", choices=sorted(SPECS), default=None)
    run.add_argument("servers", nargs="*", default=list(DEFAULT_SERVERS))
    return parser


def run_agents(args: argparse.Namespace) -> None:
    """`agents`: start the agent stack, print its URLs, keep it until Ctrl-C or SIGTERM."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with AgentStack(version=args.version) as stack:
        stack.policy.knobs = Knobs(delay=args.policy_delay, tool_turns=args.tool_turns)
        print(
            f"NeMo Gym {stack.version} agent stack: head {stack.head_url} (policy "
            f"{stack.policy.base_url}, pid {stack.policy.pid})"
        )
        for name, url in {**stack.agent_urls, **stack.environment_urls}.items():
            print(f"{name} {url}")
        sys.stdout.flush()
        with contextlib.suppress(KeyboardInterrupt):
            while stack.gym is not None and stack.gym.running():
                time.sleep(1)


def run_servers(args: argparse.Namespace) -> None:
    """`run`: start the resources servers, print their URLs, keep them until Ctrl-C or
    SIGTERM."""
    # Also when started in the background (`&` leaves SIGINT ignored) or by `kill`.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with NemoGymServers(args.servers, version=args.version) as gym:
        print(
            f"NeMo Gym {gym.version}: head {gym.head_url} (ng_run pid {gym.pid}, "
            f"up in {gym.startup_seconds} s)"
        )
        for name, url in gym.server_urls.items():
            print(f"{name} {url}")
        sys.stdout.flush()
        with contextlib.suppress(KeyboardInterrupt):
            while gym.running():
                time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
