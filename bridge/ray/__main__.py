"""`python -m nemo_gym_grpc.bridge.ray start|status|stop`: the bridge fleet on a Ray cluster.

    start [--address A] [--port P] [--cpus C] [--max-restarts N] -- SERVE FLAGS...
    status [--address A]        the registry table as JSON, one bridge per node
    stop [--address A] [--grace S]

`--address` is the cluster's (as `ray.init(address=...)` takes it; default env RAY_ADDRESS,
else the cluster this node belongs to). Exit status: 0 done, 1 a bridge did not start or no
cluster was found (one line on stderr), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

try:
    import ray
except ModuleNotFoundError:  # one line, not a traceback: the [ray] extra is not installed
    sys.exit(
        "python -m nemo_gym_grpc.bridge.ray needs Ray 2.60, the [ray] extra: "
        "pip install '.[ray]' in a clone of nemo-gym-grpc"
    )

from nemo_gym_grpc.bridge.ray import fleet
from nemo_gym_grpc.bridge.ray.fleet import (
    DEFAULT_PORT,
    NAMESPACE,
    bridge_table,
    start_bridges,
    stop_bridges,
)
from nemo_gym_grpc.shared.flags import non_negative_float, positive_int


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym_grpc.bridge.ray", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="a bridge on every node that has none")
    status = commands.add_parser("status", help="print the bridges, by node, as JSON")
    stop = commands.add_parser("stop", help="drain and end every bridge")
    for cmd in (start, status, stop):
        cmd.add_argument("--address", help="Ray cluster address (default: env RAY_ADDRESS)")
    start.add_argument("--port", type=positive_int, default=DEFAULT_PORT, help="bridge port")
    start.add_argument(
        "--cpus", type=non_negative_float, default=1.0, help="CPUs per bridge (= its workers)"
    )
    start.add_argument(
        "--max-restarts", type=int, default=-1, help="Ray restarts per bridge (-1: no limit)"
    )
    start.add_argument("serve_args", nargs="*", help="`nemo-gym-grpc serve` flags, after --")
    stop.add_argument(
        "--grace",
        type=non_negative_float,
        default=fleet.STOP_GRACE,
        help="seconds to drain each bridge",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (module docstring)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        ray.init(address=args.address or "auto", namespace=NAMESPACE, log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        print(f"nemo_gym_grpc.bridge.ray: no Ray cluster: {exc}", file=sys.stderr)
        return 1
    if args.command == "start":
        try:
            table = start_bridges(
                args.serve_args, port=args.port, cpus=args.cpus, max_restarts=args.max_restarts
            )
        except ValueError as exc:
            print(f"nemo_gym_grpc.bridge.ray: {exc}", file=sys.stderr)
            return 2
        except ray.exceptions.RayError as exc:
            print(f"nemo_gym_grpc.bridge.ray: a bridge did not start: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(table, indent=2, sort_keys=True))
    elif args.command == "status":
        print(json.dumps(bridge_table(), indent=2, sort_keys=True))
    else:
        print(f"stopped {stop_bridges(args.grace)} bridges")
    return 0


if __name__ == "__main__":
    sys.exit(main())
