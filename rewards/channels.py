"""gRPC channels to the bridge: security (TLS, mTLS, bearer token), load balancing, caching.

Security comes from environment variables (read at each reward call, see `Security.from_env`):

- `NEMO_GYM_GRPC_CA`: path of a PEM CA bundle. Set = connect with TLS, trusting that CA.
- `NEMO_GYM_GRPC_CLIENT_CERT`, `NEMO_GYM_GRPC_CLIENT_KEY`: paths of a PEM client certificate
  chain and its private key, for a bridge started with `--tls-client-ca` (mTLS). Both or
  neither; they need `NEMO_GYM_GRPC_CA`.
- `NEMO_GYM_GRPC_TOKEN`: bearer token, sent as gRPC metadata `authorization: Bearer <token>`
  on every call. The bridge reads the same variable, so an embedded bridge started by a
  process with it set requires that token, and the reward functions send it.

TLS applies to a configured target (`NEMO_GYM_GRPC_TARGET` or `target=`); an embedded bridge
listens in plaintext on loopback, and only the token applies to it.

Load balancing: every channel uses gRPC's `round_robin` policy (service config
`{"loadBalancingConfig": [{"round_robin": {}}]}`), so a target that resolves to several
addresses spreads calls over all of them and skips those that refuse connections: a list
(`ipv4:10.0.0.1:50051,10.0.0.2:50051`) or a DNS name with several records
(`dns:///bridge.ns.svc.cluster.local:50051`, e.g. a Kubernetes headless Service). One call
(one batch's `VerifyStream`) goes to one bridge; successive calls rotate.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from nemo_gym_grpc.rewards import settings
from nemo_gym_grpc.v1 import verify_pb2_grpc

MiB = 1024 * 1024
MAX_MESSAGE_BYTES = 64 * MiB
ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
POLL_SETTLE_SECONDS = 0.25  # a little over grpc's connectivity polling interval (0.2 s)

CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_reconnect_backoff_ms", 5000),
    ("grpc.service_config", ROUND_ROBIN),
]


def _read_pem(env: str, path: str) -> bytes:
    try:
        data = open(path, "rb").read()  # noqa: SIM115 - tiny file, closed by refcount
    except OSError as exc:
        raise ValueError(f"{env}={path!r}: cannot read it: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{env}={path!r} is not a PEM file")
    return data


@dataclass(frozen=True)
class Security:
    """How a client proves who it talks to and who it is.

    Attributes:
        ca: PEM CA bundle (bytes) to verify the bridge's certificate; None = plaintext.
        client_cert: PEM certificate chain presented to the bridge (mTLS), or None.
        client_key: PEM private key of `client_cert`, or None.
        token: bearer token sent as `authorization: Bearer <token>`, or None.
    """

    ca: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None
    token: str | None = None

    @classmethod
    def from_env(cls, *, tls: bool = True) -> Security:
        """Read `NEMO_GYM_GRPC_CA`, `NEMO_GYM_GRPC_CLIENT_CERT`, `NEMO_GYM_GRPC_CLIENT_KEY`
        and `NEMO_GYM_GRPC_TOKEN` (files are read now, so rotated files take effect on the
        next call). `tls=False` (an embedded bridge) ignores the TLS variables.

        Raises:
            ValueError: a file cannot be read or is not PEM; a client certificate without
                its key (or the reverse) or without a CA; a token with characters gRPC
                metadata cannot carry (only printable ASCII). The message names the variable.
        """
        token = settings.env_text(settings.TOKEN_ENV)
        if token is not None and not all(" " <= ch <= "~" for ch in token):
            raise ValueError(f"{settings.TOKEN_ENV} must be printable ASCII")
        if not tls:
            return cls(token=token)
        ca = settings.env_text(settings.CA_ENV)
        cert = settings.env_text(settings.CLIENT_CERT_ENV)
        key = settings.env_text(settings.CLIENT_KEY_ENV)
        if bool(cert) != bool(key):
            raise ValueError(
                f"{settings.CLIENT_CERT_ENV} and {settings.CLIENT_KEY_ENV} go together"
            )
        if cert and not ca:
            raise ValueError(f"{settings.CLIENT_CERT_ENV} needs {settings.CA_ENV} (TLS)")
        return cls(
            ca=_read_pem(settings.CA_ENV, ca) if ca else None,
            client_cert=_read_pem(settings.CLIENT_CERT_ENV, cert) if cert else None,
            client_key=_read_pem(settings.CLIENT_KEY_ENV, key) if key else None,
            token=token,
        )

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials, or None for plaintext."""
        if self.ca is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca,
            private_key=self.client_key,
            certificate_chain=self.client_cert,
        )

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Call metadata: the `authorization` header when there is a token, else None."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else None


PLAINTEXT = Security()


class Connection:
    """A sync channel to one target, its stub and its security; stoppable from any thread.

    `close()` cancels every call started with `stream()` and every `wait_ready` in progress
    (a plain `grpc.channel_ready_future` would keep waiting), and refuses new ones. The grpc
    channel itself is released with this object, or by `release()` in a process about to
    exit: `grpc.Channel.close()` soon after a readiness wait races with grpc's
    connectivity-polling thread, which then raises "Channel closed!" in that thread.

    Attributes:
        target: gRPC target, e.g. "127.0.0.1:50051", "ipv4:10.0.0.1:50051,10.0.0.2:50051",
            "dns:///bridge:50051".
        security: how the channel was secured (its token is not used; calls pass theirs).
        channel: the `grpc.Channel`; stub: its `VerifyServiceStub`.
        closed: True once `close()` was called.
    """

    def __init__(self, target: str, security: Security = PLAINTEXT) -> None:
        self.target = target
        self.security = security
        credentials = security.credentials()
        if credentials is None:
            self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
        self.stub = verify_pb2_grpc.VerifyServiceStub(self.channel)
        self.closed = False
        self._waits: set[grpc.Future] = set()
        self._calls: set[grpc.Call] = set()
        self._lock = threading.Lock()

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to `timeout` s until the channel can carry calls (some address answered
        the handshake). True when ready; False on timeout or when closed meanwhile."""
        future = grpc.channel_ready_future(self.channel)
        with self._lock:
            if self.closed:
                future.cancel()
                return False
            self._waits.add(future)
        try:
            future.result(timeout=timeout)
            return True
        except (grpc.FutureTimeoutError, grpc.FutureCancelledError):
            future.cancel()
            return False
        finally:
            with self._lock:
                self._waits.discard(future)

    @contextlib.contextmanager
    def stream(self, messages: Iterator[Any], **kwargs: Any) -> Iterator[Any]:
        """A `VerifyStream` call (`kwargs` as for the stub: timeout, metadata, ...) that
        `close()` cancels; yields None, starting nothing, when already closed."""
        with self._lock:
            call = None if self.closed else self.stub.VerifyStream(messages, **kwargs)
            if call is not None:
                self._calls.add(call)
        try:
            yield call
        finally:
            if call is not None:
                with self._lock:
                    self._calls.discard(call)

    def close(self) -> None:
        """Cancel every call and readiness wait in progress; refuse new ones. Idempotent."""
        with self._lock:
            self.closed = True
            waits, self._waits = list(self._waits), set()
            calls, self._calls = list(self._calls), set()
        for future in waits:
            future.cancel()
        for call in calls:
            call.cancel()

    def release(self) -> None:
        """`close()`, then close the grpc channel once grpc's connectivity polling (every
        0.2 s) has settled: takes POLL_SETTLE_SECONDS. For a process about to exit: a channel
        left to the garbage collector at interpreter exit can wait forever on that polling
        thread, a daemon thread already stopped (seen with `score` exiting right after a
        failed readiness wait)."""
        self.close()
        time.sleep(POLL_SETTLE_SECONDS)
        self.channel.close()


def aio_channel(target: str, security: Security = PLAINTEXT) -> grpc.aio.Channel:
    """A new `grpc.aio` channel on the running event loop, with `security`'s credentials."""
    credentials = security.credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)


_lock = threading.Lock()
_pid = os.getpid()
_shared: dict[tuple, Connection] = {}
# Connections inherited over fork: kept referenced, never used or closed in the child.
_inherited: list[Connection] = []


def shared(target: str, security: Security = PLAINTEXT) -> Connection:
    """The process's `Connection` for `target` with these TLS files, created on first use.

    Thread-safe; one per (target, CA, client certificate, client key); the token is not part
    of the key (it travels per call). In a forked child, the parent's are set aside (grpc
    state does not survive fork) and new ones made.
    """
    global _pid
    key = (target, security.ca, security.client_cert, security.client_key)
    with _lock:
        if os.getpid() != _pid:
            _inherited.extend(_shared.values())
            _shared.clear()
            _pid = os.getpid()
        connection = _shared.get(key)
        if connection is None:
            connection = _shared[key] = Connection(target, Security(*key[1:]))
        return connection
