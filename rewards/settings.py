"""Environment variables read by the reward functions (at call time, not at import).

- `NEMO_GYM_GRPC_TARGET` (unset): gRPC target of a running bridge ("host:port", or several
  bridges: "ipv4:HOST:PORT,HOST:PORT" / "dns:///NAME:PORT", balanced round robin); unset =
  start an embedded bridge on first use (`embedded.py`).
- `NEMO_GYM_GRPC_CA`, `NEMO_GYM_GRPC_CLIENT_CERT`, `NEMO_GYM_GRPC_CLIENT_KEY` (unset): PEM
  paths for TLS to the target (CA set = TLS) and mTLS (client certificate and key).
- `NEMO_GYM_GRPC_TOKEN` (unset): bearer token sent on every call (`channels.py`).
- `NEMO_GYM_HEAD_URL` (`http://127.0.0.1:11000`): the NeMo Gym head server that the embedded
  bridge of `reward_nemo_gym_verify` discovers resources servers from.
- `NEMO_GYM_GRPC_BATCH_TIMEOUT` (600): gRPC deadline, in seconds, of one batch's
  `VerifyStream` call.
- `NEMO_GYM_GRPC_CONNECT_TIMEOUT` (60): seconds one batch waits for a connection to the
  bridge (within the batch deadline) before all its items fail with UNAVAILABLE.
- `NEMO_GYM_GRPC_STARTUP_TIMEOUT` (60): seconds to wait for an embedded bridge to serve.
- `NEMO_GYM_GRPC_ON_ERROR` (`none`): what a failed item gives: `none` (None, which TRL reads as
  NaN), `zero` (0.0, as axolotl's own functions did) or `raise` (the call raises).
- `NEMO_GYM_GRPC_MAX_FAILURE_FRACTION` (0.5): the call raises when more than this fraction of
  a batch failed, whatever `NEMO_GYM_GRPC_ON_ERROR` says; 1 turns the guard off.
"""

from __future__ import annotations

import math
import os
from typing import Any
from urllib.parse import urlsplit

TARGET_ENV = "NEMO_GYM_GRPC_TARGET"
HEAD_URL_ENV = "NEMO_GYM_HEAD_URL"
BATCH_TIMEOUT_ENV = "NEMO_GYM_GRPC_BATCH_TIMEOUT"
CONNECT_TIMEOUT_ENV = "NEMO_GYM_GRPC_CONNECT_TIMEOUT"
STARTUP_TIMEOUT_ENV = "NEMO_GYM_GRPC_STARTUP_TIMEOUT"
ON_ERROR_ENV = "NEMO_GYM_GRPC_ON_ERROR"
MAX_FAILURE_FRACTION_ENV = "NEMO_GYM_GRPC_MAX_FAILURE_FRACTION"
CA_ENV = "NEMO_GYM_GRPC_CA"
CLIENT_CERT_ENV = "NEMO_GYM_GRPC_CLIENT_CERT"
CLIENT_KEY_ENV = "NEMO_GYM_GRPC_CLIENT_KEY"
TOKEN_ENV = "NEMO_GYM_GRPC_TOKEN"  # the bridge reads the same name

DEFAULT_HEAD_URL = "http://127.0.0.1:11000"  # NeMo Gym's DEFAULT_HEAD_SERVER_PORT
DEFAULT_BATCH_TIMEOUT = 600.0
DEFAULT_CONNECT_TIMEOUT = 60.0
DEFAULT_STARTUP_TIMEOUT = 60.0
ON_ERROR_CHOICES = ("none", "zero", "raise")
DEFAULT_ON_ERROR = "none"
DEFAULT_MAX_FAILURE_FRACTION = 0.5


def env_text(name: str) -> str | None:
    """The value of environment variable `name` stripped of whitespace; None if unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def env_seconds(name: str, default: float) -> float:
    """A positive, finite number of seconds from environment variable `name`.

    Returns `default` when the variable is unset or empty.

    Raises:
        ValueError: the value is not a positive finite number (the message names the variable).
    """
    text = env_text(name)
    return default if text is None else check_seconds(text, name)


def check_seconds(value: Any, source: str) -> float:
    """`value` as a float if it is a positive, finite number of seconds.

    Raises:
        ValueError: anything else (the message names `source`, e.g. the keyword or env var).
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source}={value!r} is not a number of seconds") from None
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{source}={value!r} must be a positive number of seconds")
    return number


def target() -> str | None:
    """`NEMO_GYM_GRPC_TARGET` (gRPC target of running bridges), or None when unset.

    Raises:
        ValueError: the value is a URL ("http://..."), not a gRPC target.
    """
    text = env_text(TARGET_ENV)
    if text is not None and urlsplit(text).scheme in ("http", "https", "grpc", "grpcs"):
        raise ValueError(
            f"{TARGET_ENV}={text!r} is a URL; a gRPC target is host:port (e.g. "
            "127.0.0.1:50051), ipv4:A:P,B:P or dns:///name:port"
        )
    return text


def head_url() -> str:
    """`NEMO_GYM_HEAD_URL`, default "http://127.0.0.1:11000", without a trailing slash.

    Raises:
        ValueError: the value is not an http(s) URL with a host.
    """
    text = env_text(HEAD_URL_ENV) or DEFAULT_HEAD_URL
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"{HEAD_URL_ENV}={text!r} must be the NeMo Gym head server's http(s) URL, "
            "e.g. http://127.0.0.1:11000"
        )
    return text.rstrip("/")


def batch_timeout() -> float:
    """`NEMO_GYM_GRPC_BATCH_TIMEOUT` in seconds (default 600)."""
    return env_seconds(BATCH_TIMEOUT_ENV, DEFAULT_BATCH_TIMEOUT)


def connect_timeout() -> float:
    """`NEMO_GYM_GRPC_CONNECT_TIMEOUT` in seconds (default 60)."""
    return env_seconds(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT)


def startup_timeout() -> float:
    """`NEMO_GYM_GRPC_STARTUP_TIMEOUT` in seconds (default 60)."""
    return env_seconds(STARTUP_TIMEOUT_ENV, DEFAULT_STARTUP_TIMEOUT)


def check_on_error(value: str, source: str = "on_error") -> str:
    """`value` lower-cased if it is one of "none", "zero", "raise".

    Raises:
        ValueError: anything else (the message names `source`, e.g. the env var).
    """
    choice = value.strip().lower() if isinstance(value, str) else value
    if choice not in ON_ERROR_CHOICES:
        raise ValueError(f"{source}={value!r} must be one of {', '.join(ON_ERROR_CHOICES)}")
    return choice


def check_fraction(value: float, source: str = "max_failure_fraction") -> float:
    """`value` as a float if it is a number in [0, 1].

    Raises:
        ValueError: not a number, NaN, or outside [0, 1] (the message names `source`).
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source}={value!r} is not a number") from None
    if not 0.0 <= number <= 1.0:  # also False for NaN
        raise ValueError(f"{source}={value!r} must be a fraction between 0 and 1")
    return number


def on_error() -> str:
    """`NEMO_GYM_GRPC_ON_ERROR`: "none" (default), "zero" or "raise"."""
    text = env_text(ON_ERROR_ENV)
    return DEFAULT_ON_ERROR if text is None else check_on_error(text, ON_ERROR_ENV)


def max_failure_fraction() -> float:
    """`NEMO_GYM_GRPC_MAX_FAILURE_FRACTION`: a fraction in [0, 1] (default 0.5)."""
    text = env_text(MAX_FAILURE_FRACTION_ENV)
    if text is None:
        return DEFAULT_MAX_FAILURE_FRACTION
    return check_fraction(text, MAX_FAILURE_FRACTION_ENV)
