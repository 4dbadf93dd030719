"""NeMo Gym sessions: `POST /seed_session` before an item's `/verify`, and its cookies.

NeMo Gym keeps per-rollout state behind a session cookie (Starlette's SessionMiddleware). The
seed call takes the row and answers with a `Set-Cookie`, which the item's `/verify` sends back.
The bridge's HTTP session keeps no cookies (DummyCookieJar): an item sends exactly the cookies
its own `/seed_session` reply set, and an item without a session sends none.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from http.cookies import Morsel
from typing import Any

SEED_PATH = "/seed_session"


def seed_body(verify_body: Mapping[str, Any]) -> bytes:
    """The UTF-8 JSON body of `/seed_session` for an item: its `/verify` body without
    `response` (the row's fields and `responses_create_params`)."""
    row = {key: value for key, value in verify_body.items() if key != "response"}
    return json.dumps(row, ensure_ascii=False, allow_nan=False).encode("utf-8")


def cookie_header(cookies: Mapping[str, Morsel[str]]) -> str:
    """The `Cookie` request header that sends back the cookies a reply set.

    Args:
        cookies: a reply's cookies (aiohttp `ClientResponse.cookies`, parsed from its
            `Set-Cookie` headers).

    Returns:
        "name=value; name2=value2" with each value exactly as the server sent it (quoted if it
        was), or "" when the reply set none.
    """
    return "; ".join(f"{morsel.key}={morsel.coded_value}" for morsel in cookies.values())
