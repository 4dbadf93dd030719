"""Replies that are not HTTP/1.1 the bridge reads are UPSTREAM_BAD_REPLY and not retried, over
both of its HTTP clients, which apply one table of header limits (`bridge/nemo_gym/framing.py`);
a `/seed_session` cookie that does not parse is the item's typed failure.

Scripted upstreams (tests/support/canned_http.py) on loopback: no NeMo Gym server sends broken
framing on demand.
"""

from __future__ import annotations

import aiohttp
import pytest
from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows.upstreams import Upstreams
from nemo_gym_grpc.bridge.nemo_gym import framing, http
from nemo_gym_grpc.bridge.rpc.server import _session
from nemo_gym_grpc.shared import reasons
from nemo_gym_grpc.v1 import verify_pb2
from tests.support.canned_http import CannedServer, canned
from tests.support.verifiers import verifier_for

OK = b'{"reward": 1.0}'
END = b"Connection: close\r\n\r\n" + OK


def head(*lines: bytes) -> bytes:
    """A 200 reply with `lines` as its headers (each without CRLF), then a 15-byte body."""
    return b"HTTP/1.1 200 OK\r\n" + b"".join(line + b"\r\n" for line in lines) + END


BROKEN = {
    "content_length_twice": head(b"Content-Length: 15", b"Content-Length: 16"),
    "content_length_and_chunked": head(b"Content-Length: 15", b"Transfer-Encoding: chunked"),
    "bare_cr": head(b"X-A: a\rb", b"Content-Length: 15"),
    "line_over_limit": head(b"X-A: " + b"a" * framing.MAX_LINE_BYTES, b"Content-Length: 15"),
    "70k_header_in_one_read": head(b"X-A: " + b"a" * 70_000, b"Content-Length: 15"),
    "too_many_headers": head(
        *(b"X-%d: a" % i for i in range(framing.MAX_HEADERS)), b"Content-Length: 15"
    ),
    "not_http": b"HTTX/9 what\r\n\r\n",
}
WITHIN = {
    "ok": canned(200, OK),
    "limits_reached": head(
        b"X-A: " + b"a" * (framing.MAX_LINE_BYTES - 7),
        *(b"X-%d: a" % i for i in range(framing.MAX_HEADERS - 3)),  # with the 3 others: 100
        b"Content-Length: 15",
    ),
}
OBS_FOLD = head(b"X-A: a", b" b", b"Content-Length: 15")
CLIENTS = {"plain_http": True, "aiohttp": False}


async def post_each(server: CannedServer, builtin: bool) -> dict[str, object]:
    """POST every case's path over one client: {case: Reply or ItemError}."""
    got: dict[str, object] = {}
    async with _session() as session:  # the bridge's session, with its header limits
        client = http.Client(session, builtin=builtin)
        for case in [*BROKEN, *WITHIN, "obs_fold"]:
            try:
                got[case] = await http.post(
                    client, f"{server.url}/{case}", b"{}", timeout=10, request_id=case
                )
            except errors.ItemError as exc:
                got[case] = exc
        await client.aclose()
    return got


@pytest.mark.parametrize("client", sorted(CLIENTS))
async def test_both_clients_read_replies_by_one_table(client):
    with CannedServer("127.0.0.5") as server:
        for case, raw in {**BROKEN, **WITHIN, "obs_fold": OBS_FOLD}.items():
            server.answer(f"POST /{case}", raw)
        got = await post_each(server, CLIENTS[client])
    for case in BROKEN:
        error = got[case]
        assert isinstance(error, errors.ItemError), (case, error)
        assert (error.code, error.reason) == (code_pb2.INTERNAL, reasons.UPSTREAM_BAD_REPLY), case
        assert not error.retryable and f"{server.url}/{case}" in error.message
        assert len(error.message) < 600 and "\n" not in error.message, error.message
    for case in WITHIN:
        assert isinstance(got[case], http.Reply) and got[case].body == OK, (case, got[case])
    # obs-fold: the table's one difference (see framing.py)
    assert isinstance(got["obs_fold"], http.Reply if client == "aiohttp" else errors.ItemError)


def item(request_id: str, **fields: object) -> verify_pb2.VerifyRequest:
    return verify_pb2.VerifyRequest(
        request_id=request_id, resources_server="s", completion="B", **fields
    )


async def test_a_broken_reply_is_posted_once():
    with CannedServer("127.0.0.5") as server:
        server.answer("POST /verify", BROKEN["content_length_twice"])
        async with aiohttp.ClientSession() as session:
            verifier = verifier_for(Upstreams({"s": server.url}), session)
            result = await verifier.verify(item("one"), None)
    assert result.error.code == code_pb2.INTERNAL and "Content-Len" in result.error.message
    assert server.seen.count("POST /verify") == 1, server.seen


async def test_a_seed_cookie_that_does_not_parse_is_the_items_typed_failure(caplog):
    with CannedServer("127.0.0.5") as server:
        server.answer("POST /seed_session", canned(200, b"{}", Set_Cookie=",a=b"))
        server.answer("POST /verify", canned(200, OK))
        async with aiohttp.ClientSession() as session:
            verifier = verifier_for(Upstreams({"s": server.url}), session)
            result = await verifier.verify(item("c", seed_session=True), None)
    info = errors_of(result)
    assert (result.error.code, info.reason) == (
        code_pb2.INTERNAL,
        reasons.UPSTREAM_SESSION_FAILED,
    )
    assert "set a cookie that does not parse: ,a=b" in result.error.message
    assert "Traceback" not in caplog.text and "POST /verify" not in server.seen


def errors_of(result: verify_pb2.VerifyResponse):
    from google.rpc import error_details_pb2

    info = error_details_pb2.ErrorInfo()
    result.error.details[0].Unpack(info)
    return info


async def test_a_liveness_redirect_is_no_answer_and_is_not_followed():
    with CannedServer("127.0.0.2") as elsewhere, CannedServer("127.0.0.5") as server:
        elsewhere.answer("GET /", canned(200, b"{}"))
        server.answer("GET /", canned(302, Location=f"{elsewhere.url}/"))
        async with _session() as session:
            assert not await http.answers(session, server.url, 5.0)
    assert server.seen == ["GET /"] and elsewhere.seen == []


@pytest.mark.parametrize("client", sorted(CLIENTS))
async def test_a_post_redirect_is_a_typed_failure_naming_where_it_pointed(client):
    with CannedServer("127.0.0.2") as elsewhere, CannedServer("127.0.0.5") as server:
        elsewhere.answer("POST /verify", canned(200, OK))
        target = f"{elsewhere.url}/verify"
        server.answer("POST /verify", canned(307, Location=target))
        async with _session() as session:
            upstreams = Upstreams({"s": server.url})
            verifier = verifier_for(upstreams, session, builtin=CLIENTS[client])
            result = await verifier.verify(item("r"), None)
    assert result.error.code == code_pb2.INTERNAL
    assert f"a redirect to {target}, not followed" in result.error.message
    assert errors_of(result).metadata["redirectLocation"] == target
    assert elsewhere.seen == []


async def test_a_seed_session_redirect_names_where_it_pointed_too():
    with CannedServer("127.0.0.2") as elsewhere, CannedServer("127.0.0.5") as server:
        target = f"{elsewhere.url}/seed_session"
        server.answer("POST /seed_session", canned(302, Location=target))
        async with aiohttp.ClientSession() as session:
            verifier = verifier_for(Upstreams({"s": server.url}), session)
            result = await verifier.verify(item("c", seed_session=True), None)
    assert errors_of(result).reason == reasons.UPSTREAM_SESSION_FAILED
    assert f"a redirect to {target}, not followed" in result.error.message
    assert elsewhere.seen == []
