"""How `config.BridgeConfig` declares its fields: each with the flag(s) that set it and the
conversion from their values (`setting`, `option`, `routes`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import Any

from nemo_gym_grpc.shared.flags import Flag, server_entry


def _same(value: Any) -> Any:
    return value


def setting(*flags: Flag, convert: Callable[..., Any] = _same) -> Any:
    """A `BridgeConfig` field set by `flags`: its value is `convert(*the flags' values)`, and
    its default `convert(*the flags' defaults)`."""
    return field(
        default_factory=lambda: convert(*(flag.default for flag in flags)),
        metadata={"flags": flags, "convert": convert},
    )


def option(name: str, text: str, *, convert: Callable[..., Any] = _same, **flag: Any) -> Any:
    """A `BridgeConfig` field set by the one flag `Flag(name, text, **flag)` (see `setting`)."""
    return setting(Flag(name, text, **flag), convert=convert)


def _replicas(entries: list[tuple[str, str]]) -> dict[str, str | list[str]]:
    """`--server` entries grouped by name: {name: [base URL, ...]} in the order given."""
    grouped: dict[str, list[str]] = {}
    for name, url in entries:
        grouped.setdefault(name, []).append(url)
    return {name: urls for name, urls in grouped.items()}


def routes(flag: str, text: str) -> Any:
    """A routing table field set by the repeatable `flag NAME=URL` (`server_entry`):
    {name: [base URL, ...]}."""
    return option(
        flag,
        text,
        type=server_entry,
        default=(),
        kind="list",
        metavar="NAME=URL",
        convert=_replicas,
    )
