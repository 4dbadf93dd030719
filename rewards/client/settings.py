"""Every `NEMO_GYM_*` environment variable the trainer side reads: names, defaults, parsers.

This is the one list; other modules read the variables only through the functions here. Each
is read at call time (not at import), so a change takes effect on the next reward call. An
explicit keyword (`create_nemo_gym_reward_fn(...)`) or flag (`score --...`) wins over its
variable (`resolve`); unset or empty means the default.

- `NEMO_GYM_GRPC_TARGET` (unset): gRPC target of a running bridge ("host:port", or several
  bridges: "ipv4:HOST:PORT,HOST:PORT" / "dns:///NAME:PORT", balanced round robin), or "ray:"
  (the bridges of the Ray cluster this process belongs to, its node's first: `ray_target.py`);
  unset = start an embedded bridge on first use (`embedded.py`).
- `NEMO_GYM_GRPC_CA` (unset): path of a PEM CA bundle; set = connect to the target with TLS,
  trusting that CA.
- `NEMO_GYM_GRPC_CLIENT_CERT`, `NEMO_GYM_GRPC_CLIENT_KEY` (unset): paths of a PEM client
  certificate chain and its key, for a bridge started with `--tls-client-ca` (mTLS); both or
  neither, and they need `NEMO_GYM_GRPC_CA`. TLS applies to a configured target only: an
  embedded bridge listens in plaintext on loopback.
- `NEMO_GYM_GRPC_TOKEN` (unset): bearer token sent as `authorization: Bearer <token>` on every
  call; a wrong or missing one fails the items with UNAUTHENTICATED. The bridge reads the same
  variable, so an embedded bridge started with it set requires it.
- `NEMO_GYM_HEAD_URL` (`http://127.0.0.1:11000`): the NeMo Gym head server that an embedded
  bridge discovers resources servers from.
- `NEMO_GYM_GRPC_BATCH_TIMEOUT` (600): gRPC deadline, in seconds, of one batch's
  `VerifyStream` call.
- `NEMO_GYM_GRPC_ROLLOUT_BATCH_TIMEOUT` (10800): gRPC deadline, in seconds, of one batch of
  rollouts' `RunStream` call (`run_rollouts`, the TRL `rollout_func`): every rollout of the
  batch ends by then (a rollout without a result fails with DEADLINE_EXCEEDED).
- `NEMO_GYM_GRPC_RUN_TIMEOUT` (unset): seconds one rollout's agent `/run` call may take
  (`RunRequest.timeout_seconds`); unset = the bridge's `--run-timeout`.
  The bridge reads the same variable for that default, so an embedded bridge agrees.
- `NEMO_GYM_GRPC_CONNECT_TIMEOUT` (60): seconds one batch waits for a connection to the
  bridge (within the batch deadline) before all its items fail with UNAVAILABLE.
- `NEMO_GYM_GRPC_STARTUP_TIMEOUT` (60): seconds to wait for an embedded bridge to serve.
- `NEMO_GYM_GRPC_ON_ERROR` (`none`): what a failed item gives: `none` (None, which TRL reads as
  NaN), `zero` (0.0, as axolotl's own functions did) or `raise` (the call raises).
- `NEMO_GYM_GRPC_MAX_FAILURE_FRACTION` (0.5): the call raises when more than this fraction of
  a batch failed, whatever `NEMO_GYM_GRPC_ON_ERROR` says; 1 turns the guard off.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from nemo_gym_grpc.rewards.client.channels import Security
from nemo_gym_grpc.shared.contract import DEFAULT_HEAD_URL, RUN_TIMEOUT_ENV, TOKEN_ENV
from nemo_gym_grpc.shared.flags import http_url

T = TypeVar("T")

TARGET_ENV = "NEMO_GYM_GRPC_TARGET"
HEAD_URL_ENV = "NEMO_GYM_HEAD_URL"
BATCH_TIMEOUT_ENV = "NEMO_GYM_GRPC_BATCH_TIMEOUT"
CONNECT_TIMEOUT_ENV = "NEMO_GYM_GRPC_CONNECT_TIMEOUT"
ROLLOUT_BATCH_TIMEOUT_ENV = "NEMO_GYM_GRPC_ROLLOUT_BATCH_TIMEOUT"
STARTUP_TIMEOUT_ENV = "NEMO_GYM_GRPC_STARTUP_TIMEOUT"
ON_ERROR_ENV = "NEMO_GYM_GRPC_ON_ERROR"
MAX_FAILURE_FRACTION_ENV = "NEMO_GYM_GRPC_MAX_FAILURE_FRACTION"
CA_ENV = "NEMO_GYM_GRPC_CA"
CLIENT_CERT_ENV = "NEMO_GYM_GRPC_CLIENT_CERT"
CLIENT_KEY_ENV = "NEMO_GYM_GRPC_CLIENT_KEY"

DEFAULT_BATCH_TIMEOUT = 600.0
DEFAULT_CONNECT_TIMEOUT = 60.0
DEFAULT_ROLLOUT_BATCH_TIMEOUT = 10800.0  # axolotl's multi-turn total timeout
DEFAULT_STARTUP_TIMEOUT = 60.0
ON_ERROR_CHOICES = ("none", "zero", "raise")
DEFAULT_ON_ERROR = "none"
DEFAULT_MAX_FAILURE_FRACTION = 0.5


def resolve(explicit: T | None, from_env: Callable[[], T]) -> T:
    """`explicit` (a keyword or flag) when it is not None, else `from_env()` (its variable)."""
    return from_env() if explicit is None else explicit


def optional(check: Callable[[Any, str], T], value: Any, source: str) -> T | None:
    """None when `value` is None (a keyword left to its variable), else `check(value, source)`
    (e.g. `check_seconds`), which raises ValueError naming `source`."""
    return None if value is None else check(value, source)


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
    return None if text is None else check_target(text, TARGET_ENV)


def check_target(text: str, source: str) -> str:
    """`text` if it can be a gRPC target (`NEMO_GYM_GRPC_TARGET`, a `target=` keyword,
    `score --target`).

    Raises:
        ValueError: `text` is a URL ("http://..."); the message names `source`.
    """
    if urlsplit(text).scheme in ("http", "https", "grpc", "grpcs"):
        raise ValueError(
            f"{source}={text!r} is a URL; a gRPC target is host:port (e.g. "
            "127.0.0.1:50051), ipv4:A:P,B:P or dns:///name:port"
        )
    return text


def head_url() -> str:
    """`NEMO_GYM_HEAD_URL` (`DEFAULT_HEAD_URL`), without a trailing slash.

    Raises:
        ValueError: the value is not an http(s) URL with a host (the rule of the bridge's
            `--head-url`, `flags.http_url`); the message names the variable.
    """
    text = env_text(HEAD_URL_ENV) or DEFAULT_HEAD_URL
    try:
        return http_url(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{HEAD_URL_ENV}: {exc}") from None


def batch_timeout() -> float:
    """`NEMO_GYM_GRPC_BATCH_TIMEOUT` in seconds (`DEFAULT_BATCH_TIMEOUT`)."""
    return env_seconds(BATCH_TIMEOUT_ENV, DEFAULT_BATCH_TIMEOUT)


def rollout_batch_timeout() -> float:
    """`NEMO_GYM_GRPC_ROLLOUT_BATCH_TIMEOUT` in seconds (`DEFAULT_ROLLOUT_BATCH_TIMEOUT`)."""
    return env_seconds(ROLLOUT_BATCH_TIMEOUT_ENV, DEFAULT_ROLLOUT_BATCH_TIMEOUT)


def run_timeout() -> float:
    """`NEMO_GYM_GRPC_RUN_TIMEOUT` in seconds; 0.0 (the bridge's default) when unset."""
    return env_seconds(RUN_TIMEOUT_ENV, 0.0)


def connect_timeout() -> float:
    """`NEMO_GYM_GRPC_CONNECT_TIMEOUT` in seconds (`DEFAULT_CONNECT_TIMEOUT`)."""
    return env_seconds(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT)


def startup_timeout() -> float:
    """`NEMO_GYM_GRPC_STARTUP_TIMEOUT` in seconds (`DEFAULT_STARTUP_TIMEOUT`)."""
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


def check_fraction(value: float | str, source: str = "max_failure_fraction") -> float:
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
    """`NEMO_GYM_GRPC_MAX_FAILURE_FRACTION`: a fraction in [0, 1]
    (`DEFAULT_MAX_FAILURE_FRACTION`)."""
    text = env_text(MAX_FAILURE_FRACTION_ENV)
    if text is None:
        return DEFAULT_MAX_FAILURE_FRACTION
    return check_fraction(text, MAX_FAILURE_FRACTION_ENV)


def _read_pem(env: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"{env}={path!r}: cannot read it: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{env}={path!r} is not a PEM file")
    return data


def security(*, tls: bool = True) -> Security:
    """`NEMO_GYM_GRPC_TOKEN` and (with `tls`) the TLS files: `NEMO_GYM_GRPC_CA`,
    `NEMO_GYM_GRPC_CLIENT_CERT`, `NEMO_GYM_GRPC_CLIENT_KEY`. The files are read now, so rotated
    files take effect on the next call. `tls=False` (an embedded bridge) ignores the TLS ones.

    Raises:
        ValueError: a file cannot be read or is not PEM; a client certificate without its
            key (or the reverse) or without a CA; a token with characters gRPC metadata
            cannot carry (only printable ASCII). The message names the variable.
    """
    token = env_text(TOKEN_ENV)
    if token is not None and not all(" " <= ch <= "~" for ch in token):
        raise ValueError(f"{TOKEN_ENV} must be printable ASCII")
    if not tls:
        return Security(token=token)
    ca = env_text(CA_ENV)
    cert = env_text(CLIENT_CERT_ENV)
    key = env_text(CLIENT_KEY_ENV)
    if bool(cert) != bool(key):
        raise ValueError(f"{CLIENT_CERT_ENV} and {CLIENT_KEY_ENV} go together")
    if cert and not ca:
        raise ValueError(f"{CLIENT_CERT_ENV} needs {CA_ENV} (TLS)")
    return Security(
        ca=_read_pem(CA_ENV, ca) if ca else None,
        client_cert=_read_pem(CLIENT_CERT_ENV, cert) if cert else None,
        client_key=_read_pem(CLIENT_KEY_ENV, key) if key else None,
        token=token,
    )
