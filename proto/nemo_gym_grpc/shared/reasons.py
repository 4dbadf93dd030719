"""The reasons of per-item failures (`google.rpc.ErrorInfo.reason`, domain ERROR_DOMAIN) that
the bridge sets and the trainer side matches on (docs/failures.md lists each with its code and
what to do), and the codes whose cause is usually gone a moment later."""

from __future__ import annotations

from google.rpc import code_pb2

ERROR_DOMAIN = "nemo-gym-grpc"

# Reasons (ErrorInfo.reason) the bridge sets.
INVALID_ITEM = "INVALID_ITEM"
ITEM_TOO_LARGE = "ITEM_TOO_LARGE"
UNKNOWN_RESOURCES_SERVER = "UNKNOWN_RESOURCES_SERVER"
HEAD_SERVER_UNAVAILABLE = "HEAD_SERVER_UNAVAILABLE"
UPSTREAM_UNAVAILABLE = "UPSTREAM_UNAVAILABLE"
UPSTREAM_TIMEOUT = "UPSTREAM_TIMEOUT"
UPSTREAM_HTTP_ERROR = "UPSTREAM_HTTP_ERROR"
UPSTREAM_BAD_REPLY = "UPSTREAM_BAD_REPLY"
# A server the bridge will not dial: its head-server entry's host or port is malformed, or its
# address is on the deny list (`--deny-upstream`).
UPSTREAM_ADDRESS_REFUSED = "UPSTREAM_ADDRESS_REFUSED"
# A reply body over the bridge's `--max-reply-mb`, as sent or as decompressed.
UPSTREAM_REPLY_TOO_LARGE = "UPSTREAM_REPLY_TOO_LARGE"
UPSTREAM_JUDGE_FAILED = "UPSTREAM_JUDGE_FAILED"
UPSTREAM_MASKED_SAMPLE = "UPSTREAM_MASKED_SAMPLE"
UPSTREAM_SESSION_FAILED = "UPSTREAM_SESSION_FAILED"
BRIDGE_INTERNAL = "BRIDGE_INTERNAL"
# A result larger than one stream message may be (`--max-message-mb`).
RESULT_TOO_LARGE = "RESULT_TOO_LARGE"
# A whole stream the bridge ended because it held nothing and received nothing for
# `--stream-idle-timeout` seconds (UNAVAILABLE: open a new one when there is work).
STREAM_IDLE = "STREAM_IDLE"
# Rollouts (RolloutService).
UNKNOWN_AGENT = "UNKNOWN_AGENT"
UPSTREAM_EPISODE_FAILED = "UPSTREAM_EPISODE_FAILED"
# Sessions (SessionService).
SESSION_NOT_FOUND = "SESSION_NOT_FOUND"
UNKNOWN_TOOL = "UNKNOWN_TOOL"
TOO_MANY_SESSIONS = "TOO_MANY_SESSIONS"
# Step on a session that is not step-wise, or VerifySession on one that is.
NOT_STEP_WISE = "NOT_STEP_WISE"

# Codes whose cause is usually gone a moment later (gRPC's status-code guide).
RETRYABLE_CODES = frozenset({code_pb2.UNAVAILABLE, code_pb2.RESOURCE_EXHAUSTED})
