"""Command-line flags declared once, each with an environment-variable fallback.

A `Flag` is one option: its name, help, value type and default. `add_flags` puts flags on an
argparse parser (help ends with `[env: NAME]`); after parsing, `resolve` gives every flag its
value: the command line beats the environment variable, which beats the default. The variable
is `NEMO_GYM_GRPC_<FLAG_IN_CAPS>` (`--max-in-flight` -> `NEMO_GYM_GRPC_MAX_IN_FLIGHT`) unless the
flag names another. A bad value in the environment is refused like a bad flag: exit status 2
and one line naming the variable. The value types below are argparse types: they raise
`argparse.ArgumentTypeError` with a message that argparse prints after the flag's name.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from nemo_gym_grpc.shared import addresses

ENV_PREFIX = "NEMO_GYM_GRPC_"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def env_name(flag: str) -> str:
    """The environment variable of `flag`: "--max-in-flight" -> "NEMO_GYM_GRPC_MAX_IN_FLIGHT"."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


@dataclass(frozen=True)
class Flag:
    """One command-line option.

    Attributes:
        name: the option, e.g. "--max-in-flight".
        help: what it sets, with units; `add_flags` appends the default and the variable.
        type: parses one value from text (an argparse type).
        default: the value when neither the flag nor its variable is set.
        kind: "value" (`--flag VALUE`), "switch" (`--flag` alone sets True; the variable
            takes 1/true/yes/on or 0/false/no/off) or "list" (repeatable; the variable holds
            the values separated by commas).
        metavar: the value's name in help; None = the name in capitals.
        choices: the only values allowed, or None.
        env: the environment variable; "" = `env_name(name)`.
        env_type: parses the variable's text when it means something else than the flag's
            value (the token file's variable holds the token itself); None = `type`.
    """

    name: str
    help: str
    type: Callable[[str], Any] = str
    default: Any = None
    kind: Literal["value", "switch", "list"] = "value"
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    env: str = ""
    env_type: Callable[[str], Any] | None = None

    @property
    def dest(self) -> str:
        """The attribute of the parsed namespace: "--max-in-flight" -> "max_in_flight"."""
        return self.name.lstrip("-").replace("-", "_")

    @property
    def env_var(self) -> str:
        """The name of the environment variable this flag falls back to."""
        return self.env or env_name(self.name)

    def from_env(self, text: str) -> Any:
        """The value the environment variable's `text` gives (stripped; not empty).

        Raises:
            argparse.ArgumentTypeError: `text` is no valid value.
        """
        if self.kind == "switch":
            if text.lower() in TRUE_WORDS:
                return True
            if text.lower() in FALSE_WORDS:
                return False
            raise argparse.ArgumentTypeError(
                f"expected one of {'/'.join(TRUE_WORDS + FALSE_WORDS)}, got {text!r}"
            )
        parse = self.env_type or self.type
        if self.kind == "list":
            return [self._checked(parse, part.strip()) for part in text.split(",") if part.strip()]
        return self._checked(parse, text)

    def _checked(self, parse: Callable[[str], Any], text: str) -> Any:
        try:
            value = parse(text)
        except argparse.ArgumentTypeError:
            raise
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"invalid value: {text!r}") from None
        if self.choices is not None and value not in self.choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {', '.join(self.choices)})"
            )
        return value


def add_flags(parser: argparse._ActionsContainer, flags: Iterable[Flag]) -> None:
    """Add `flags` to `parser` (or an argument group). A flag not given is left out of the
    parsed namespace, so that `resolve` can tell "not given" from "given the default"."""
    for flag in flags:
        shown = (
            f" (default {flag.default})"
            if flag.kind == "value" and flag.default is not None
            else ""
        )
        listed = ", comma-separated" if flag.kind == "list" else ""
        text = f"{flag.help}{shown} [env: {flag.env_var}{listed}]".replace("%", "%%")
        if flag.kind == "switch":
            parser.add_argument(
                flag.name, action="store_true", default=argparse.SUPPRESS, help=text
            )
            continue
        parser.add_argument(
            flag.name,
            action="append" if flag.kind == "list" else "store",
            type=flag.type,
            choices=flag.choices,
            metavar=flag.metavar,
            default=argparse.SUPPRESS,
            help=text,
        )


def resolve(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    flags: Iterable[Flag],
    environ: Mapping[str, str] = os.environ,
) -> None:
    """Set every flag's value on `args`: the flag's if given, else its environment variable's
    (unset or blank = not set), else its default (a fresh list for a list flag).

    Raises:
        SystemExit: 2, through `parser.error`, for an environment value that `Flag.from_env`
            refuses; the message names the variable.
    """
    for flag in flags:
        if hasattr(args, flag.dest):
            continue
        text = environ.get(flag.env_var, "").strip()
        if text:
            try:
                value = flag.from_env(text)
            except argparse.ArgumentTypeError as exc:
                parser.error(f"environment variable {flag.env_var}: {exc}")
        elif flag.kind == "list":
            value = list(flag.default or ())
        else:
            value = flag.default
        setattr(args, flag.dest, value)


# --- value types -------------------------------------------------------------------------


def parse_command(
    top: argparse.ArgumentParser, commands: argparse._SubParsersAction, argv: list[str] | None
) -> argparse.Namespace:
    """`top.parse_args(argv)`, except that arguments no parser knows are refused by the
    command given (`commands`, the subparsers of `top`), with that command's usage.

    Raises:
        SystemExit: 2 with a one-line message for bad arguments; 0 for `--help`.
    """
    args, unknown = top.parse_known_args(argv)
    if unknown:
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _finite(text: str, at_least: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and at_least == "> 0"):
        raise argparse.ArgumentTypeError(f"expected a finite number {at_least}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (e.g. seconds where 0 makes no sense)."""
    return _finite(text, "> 0")


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (for options where 0 has a meaning of its own)."""
    return _finite(text, ">= 0")


def port(text: str) -> int:
    """A port number 0-65535."""
    try:
        number = int(text)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return number


def listen_address(text: str) -> str:
    """HOST:PORT with a port 0-65535 ([IPv6]:PORT), or unix:PATH, as gRPC binds it."""
    if text.startswith("unix:"):
        return text
    host, _, number = text.rpartition(":")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        host = ""  # an IPv6 address needs brackets
    if host in ("", "[]") or not number.isdigit() or int(number) > 65535:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with a port 0-65535 (IPv6 as [::1]:PORT), got {text!r}"
        )
    return text


def network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """An address range in CIDR notation (169.254.0.0/16, fe80::/10) or one address."""
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an address range such as 10.0.0.0/8, got {text!r}"
        ) from None


def _url_problem(text: str) -> str:
    """Why `text` is no http(s)://HOST[:PORT][/PATH] URL of a server to call, "" when it is
    one: the scheme http or https, the host as `addresses.check_host` takes it, the port (if
    any) 1-65535, no user, query or fragment."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https"):
        return "the scheme is not http or https"
    if "@" in parts.netloc or parts.query or parts.fragment:
        return "a user, query or fragment is in it"
    try:
        addresses.check_host(parts.hostname or "")
        if parts.port is not None:
            addresses.check_port(parts.port)
    except ValueError as exc:  # (urlsplit's own for a port that is no number)
        return str(exc)
    return ""


def http_url(text: str) -> str:
    """http(s)://HOST[:PORT][/PATH] (`_url_problem`) -> the URL without a trailing slash."""
    problem = _url_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, got {text!r}: {problem}")
    return text.rstrip("/")


def server_entry(text: str) -> tuple[str, str]:
    """NAME=http(s)://HOST[:PORT][/PATH] (`_url_problem`) -> (NAME, the URL without a
    trailing slash)."""
    name, sep, url = text.partition("=")
    problem = _url_problem(url) if sep and name else "no NAME= before it"
    if problem:
        raise argparse.ArgumentTypeError(f"expected NAME=http://HOST:PORT, got {text!r}: {problem}")
    return name, url.rstrip("/")


def _read(text: str) -> bytes:
    try:
        return Path(text).read_bytes()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {exc.strerror or exc}") from None


def readable_file(text: str) -> Path:
    """The path of a file that can be read (e.g. a PEM file)."""
    _read(text)
    return Path(text)


def token_file(text: str) -> str:
    """The token held in the file named `text`, stripped; the file must not be empty."""
    try:
        token = _read(text).decode().strip()
    except UnicodeDecodeError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {exc}") from None
    if not token:
        raise argparse.ArgumentTypeError(f"{text} is empty")
    return token


def log_level(text: str) -> str:
    """A `logging` level name (DEBUG, INFO, WARNING, ERROR, CRITICAL; any case), upper-cased."""
    name = text.upper()
    if not isinstance(logging.getLevelName(name), int):
        raise argparse.ArgumentTypeError(
            f"expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {text!r}"
        )
    return name
