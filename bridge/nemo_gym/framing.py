"""HTTP/1.1 framing of the bridge's upstream calls: the limits on a reply's head that both of
its HTTP clients apply (`plain_http` for POSTs to `http://` URLs, aiohttp for the rest, its
session built with these limits by `rpc.server`), the request head `plain_http` writes, its
reply errors (`BadReply`, `TooLarge`) and how it decodes a compressed body (`decode_body`).

- one header line (name, colon, value): at most MAX_LINE_BYTES (8,190: aiohttp's default);
- header lines: at most MAX_HEADERS (100);
- the status line and headers together: at most MAX_HEAD_BYTES (plain_http counts a line
  still coming against this: llhttp hands it over only once it ends);
- Content-Length twice, Content-Length with Transfer-Encoding, a bare CR: refused (llhttp);
- obs-fold (a header continued on the next line): plain_http refuses it (llhttp's strict
  mode); aiohttp joins the lines with a space, as RFC 9112 section 5.2 has a client do, and
  has no option to refuse it. The one difference.

A reply that breaks one is UPSTREAM_BAD_REPLY, not retried (`http.post`). NeMo Gym's uvicorn
sends none of these.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from functools import lru_cache
from urllib.parse import urlsplit

MAX_LINE_BYTES = 8190
MAX_HEADERS = 100
MAX_HEAD_BYTES = (MAX_HEADERS + 1) * MAX_LINE_BYTES


class BadReply(ValueError):
    """The reply could not be read as HTTP/1.1 (llhttp refused it, or its head breaks a limit
    of `framing`, or its body does not decode): the request was sent."""


class TooLarge(BadReply):
    """The reply's body is over the client's `max_body` bytes, as sent (its Content-Length, or
    the bytes read) or as decoded (gzip / deflate): reading stopped there, the connection is
    closed. The message says which."""


@lru_cache(maxsize=1024)
def split_url(url: str) -> tuple[str, int, bytes, bytes]:
    """(host, port, request target, Host header value) of an `http://` URL.

    Raises:
        ValueError: not an http:// URL with a host.
    """
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"not a plain-HTTP URL: {url!r}")
    port = parts.port or 80
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.hostname
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{port}"
    return host, port, target.encode("ascii"), netloc.encode("idna")


def request_head(
    target: bytes, host: bytes, headers: Iterable[tuple[str, str]], size: int
) -> bytes:
    """The head of a `POST` of `size` body bytes with `headers` (name, value).

    Raises:
        ValueError: a header name or value holds CR, LF or NUL (header injection).
    """
    lines = [b"POST ", target, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
    for name, value in headers:
        if _unsafe(value) or _unsafe(name) or ":" in name:
            raise ValueError(f"header {name!r} holds CR, LF or NUL, or its name a colon")
        lines += [name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n"]
    lines += [b"Content-Length: ", str(size).encode(), b"\r\n\r\n"]
    return b"".join(lines)


def _unsafe(text: str) -> bool:
    return "\r" in text or "\n" in text or "\0" in text


def decode_body(body: bytes, encoding: bytes, limit: int) -> bytes:
    """A reply body decoded as aiohttp decodes it: gzip, deflate (zlib-wrapped, or raw when its
    first byte is no zlib header); an empty body or another encoding as it came, except the
    two aiohttp refuses without extra packages (br, zstd). A cut gzip body gives what it
    holds; a cut deflate body is refused. At most `limit` + 1 bytes are ever inflated.

    Raises:
        zlib.error: the body does not decode; BadReply: br or zstd; TooLarge: it decodes to
            more than `limit` bytes.
    """
    if not body:
        return body
    if encoding in (b"br", b"zstd"):
        raise BadReply("br and zstd bodies are not decoded")
    if encoding == b"gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif encoding == b"deflate":
        wbits = zlib.MAX_WBITS if body[0] & 0xF == 8 else -zlib.MAX_WBITS
    else:
        return body
    decoder = zlib.decompressobj(wbits)
    out = decoder.decompress(body, limit + 1)
    if len(out) > limit or decoder.unconsumed_tail:
        raise TooLarge(f"the {encoding.decode()} body inflates to more than {limit} bytes")
    out += decoder.flush()
    if encoding == b"deflate" and not decoder.eof:
        raise zlib.error("the deflate stream is cut short")
    return out
