"""gRPC channels to the bridge: credentials, channel options, the per-process channel cache.

Load balancing: every channel uses gRPC's `round_robin` policy (service config
`{"loadBalancingConfig": [{"round_robin": {}}]}`), so a target that resolves to several
addresses spreads calls over all of them and skips those that refuse connections: a list
(`ipv4:10.0.0.1:50051,10.0.0.2:50051`) or a DNS name with several records
(`dns:///bridge.ns.svc.cluster.local:50051`, e.g. a Kubernetes headless Service). One call
(one batch's `VerifyStream` or `RunStream`) goes to one bridge; successive calls rotate.
The target `ray:` (`ray_target.py`) is resolved to the Ray cluster's bridges, own node first.
A sync call (`shared`) goes on the own bridge's channel while that answers, else on a
`pick_first` channel over all of them (the first that accepts connections); an async call's
channel is always such a `pick_first` one, its own. So a call (and each stream of it, when one
breaks) goes to the own bridge when it answers and to the next live one when it does not.

Sync calls share one channel per target (and TLS files) per process (`shared`); a forked child
sets its parent's aside and makes its own (gRPC state does not survive fork). A `grpc.aio`
channel belongs to the event loop that made it, so async calls open their own (`aio_channel`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import grpc

from nemo_gym_grpc.rewards.client import ray_target
from nemo_gym_grpc.rewards.client.per_process import PerProcess
from nemo_gym_grpc.shared.contract import MAX_MESSAGE_BYTES
from nemo_gym_grpc.v1 import rollout_pb2_grpc, verify_pb2_grpc

# grpc.ChannelConnectivity.READY as the core channel reports it (an int).
_READY = grpc.ChannelConnectivity.READY.value[0]
ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})

CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # after the bridge restarts, reconnect within seconds, not gRPC's default of up to 120 s
    ("grpc.max_reconnect_backoff_ms", 5000),
    ("grpc.service_config", ROUND_ROBIN),
]
# For `ray:`: the first address that connects (the node's own bridge while it is up).
PICK_FIRST_OPTIONS = [*CHANNEL_OPTIONS[:-1], ("grpc.service_config", ray_target.PICK_FIRST)]
# A session client's one channel: pick_first, over connections of its own. By default channels
# whose options differ in the service config alone share a process-wide pool of connections, so
# a new one inherited another's reconnect backoff: to a bridge up on the port of one that had
# stopped, whose cached `round_robin` channel kept trying it, a first call failed at once
# ("Connection refused"), without waiting (sessions fail fast: no `wait_for_ready`).
SESSION_OPTIONS = [("grpc.use_local_subchannel_pool", 1), *PICK_FIRST_OPTIONS]


@dataclass(frozen=True)
class Security:
    """How a client proves who it talks to and who it is (made by `settings.security`).

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


@dataclass(frozen=True)
class Channel:
    """A sync channel and its stubs (`stub`: VerifyService, `rollouts`: RolloutService)."""

    channel: grpc.Channel
    stub: verify_pb2_grpc.VerifyServiceStub
    rollouts: rollout_pb2_grpc.RolloutServiceStub

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to `timeout` s until the channel can carry calls (some address answered
        the handshake). True when ready, False on timeout.

        A channel that is READY right now returns at once (`is_ready`, about a microsecond);
        only one that is not waits on `grpc.channel_ready_future`, which subscribes to the
        channel's connectivity and so starts a polling thread (about 0.3-0.4 ms per call
        here, measured at concurrency 1).
        """
        if self.is_ready():
            return True
        future = grpc.channel_ready_future(self.channel)
        try:
            future.result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            future.cancel()
            return False

    def is_ready(self) -> bool:
        """Whether the channel is READY now, without trying to connect and without waiting.

        grpcio's sync channel has no public way to read its state once (only a subscription,
        which starts a thread), so this asks its core channel (`grpc._channel.Channel.
        _channel.check_connectivity_state`, grpcio 1.x); where that is missing it says False
        and `wait_ready` takes the public, slower path.
        """
        core = getattr(self.channel, "_channel", None)
        check = getattr(core, "check_connectivity_state", None)
        if check is None:
            return False
        return bool(check(False) == _READY)


def aio_channel(target: str, security: Security = PLAINTEXT) -> grpc.aio.Channel:
    """A new `grpc.aio` channel on the running event loop, with `security`'s credentials; for
    `ray:`, a PICK_FIRST_OPTIONS one over `ray_target.resolve`'s bridges, own node first."""
    options = CHANNEL_OPTIONS
    if ray_target.is_ray(target):
        target, options = ray_target.resolve(target), PICK_FIRST_OPTIONS
    credentials = security.credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


_Key = tuple[str, tuple[tuple[str, int | str], ...], bytes | None, bytes | None, bytes | None]
_shared: PerProcess[_Key, Channel] = PerProcess()
HOME_PROBE_SECONDS = 0.1  # most a sync `ray:` call waits for the own bridge's channel


async def ready(
    channel: grpc.aio.Channel, timeout: float, *, refused_fails: bool = False
) -> bool | None:
    """True once `channel` is READY, None when it is not within `timeout` seconds. With
    `refused_fails`, False as soon as a connection attempt fails (TRANSIENT_FAILURE: refused,
    unreachable, or a failed TLS handshake) instead of waiting for a later one."""

    async def connected() -> bool:
        if not refused_fails:
            await channel.channel_ready()
            return True
        state = channel.get_state(try_to_connect=True)
        while state is not grpc.ChannelConnectivity.READY:
            if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                return False
            await channel.wait_for_state_change(state)
            state = channel.get_state(try_to_connect=True)
        return True

    try:
        return await asyncio.wait_for(connected(), timeout)
    except asyncio.TimeoutError:
        return None


def shared(target: str, security: Security = PLAINTEXT) -> Channel:
    """The process's sync `Channel` for `target` with these TLS files, made on first use.

    Thread-safe; one per (target, options, CA, client certificate, client key); the token is
    not part of the key (it travels per call). For `ray:` (`ray_target.resolve`): the own node's
    bridge's channel when it is READY now or within HOME_PROBE_SECONDS, else the PICK_FIRST
    channel over every bridge, own first (a sync channel on `pick_first` would stay on a
    fallback while its connection holds; this way a call goes home as soon as home answers).
    """
    if not ray_target.is_ray(target):
        return _cached(target, CHANNEL_OPTIONS, security)
    bridges = ray_target.resolve(target)
    home = _cached(ray_target.home(bridges), CHANNEL_OPTIONS, security)
    if home.is_ready() or home.wait_ready(HOME_PROBE_SECONDS):
        return home
    return _cached(bridges, PICK_FIRST_OPTIONS, security)


def _cached(target: str, options: list[tuple[str, int | str]], security: Security) -> Channel:
    key = (target, tuple(options), security.ca, security.client_cert, security.client_key)
    with _shared.lock:
        channel = _shared.entries.get(key)
        if channel is None:
            credentials = security.credentials()
            if credentials is None:
                raw = grpc.insecure_channel(target, options=options)
            else:
                raw = grpc.secure_channel(target, credentials, options=options)
            channel = _shared.entries[key] = Channel(
                raw,
                verify_pb2_grpc.VerifyServiceStub(raw),
                rollout_pb2_grpc.RolloutServiceStub(raw),
            )
        return channel
