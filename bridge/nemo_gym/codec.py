"""The bridge's JSON codec: msgspec where it reads and writes what the standard library does,
the standard library where it would not.

msgspec.json spends about a quarter of the standard library's CPU on the bridge's bodies
(measured: dumps + loads of a 3.6 KB body, 6.7 us against 27.9 us) and keeps integers beyond
64 bits exact both ways, but it refuses some text that `json.loads` reads (NaN and Infinity
literals, numbers beyond float range such as 1e400, lone surrogate escapes such as
"\\ud800", integers over 4,300 digits) and writes a float NaN or Infinity as `null`. So:

- `loads` tries msgspec and falls back to `json.loads` on any msgspec refusal, so what is read
  and the error texts are the standard library's. An object the fallback read comes back as a
  `StdlibParsed` (a plain `dict` subclass): it may hold NaN, Infinity or a lone surrogate.
- `dumps` writes with msgspec unless its value may hold those: callers pass `exact=False`
  for anything built from a `StdlibParsed` object (then the standard library writes it, with
  `allow_nan=False`, raising its own errors).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()


class StdlibParsed(dict[str, Any]):
    """A JSON object read by the standard library because msgspec refused its text: it may
    hold float NaN / Infinity or lone surrogates, so it must be written by `dumps` with
    `exact=False`."""


def loads(text: str | bytes) -> Any:
    """JSON text (str, or UTF-8 bytes) -> its Python value (dict, list, str, int, float,
    bool or None); a top-level object read by the standard library is a `StdlibParsed`.

    Raises:
        ValueError: the text is not JSON (`json.JSONDecodeError`, the standard library's
            message), or holds an integer over 4,300 digits.
        RecursionError: it nests deeper than the interpreter's recursion limit.
    """
    try:
        return _DECODER.decode(text)
    except (msgspec.DecodeError, RecursionError):  # ValidationError is a DecodeError
        value = json.loads(text)
    return StdlibParsed(value) if type(value) is dict else value


def dumps(value: Any, *, exact: bool = True) -> bytes:
    """`value` as compact UTF-8 JSON.

    Args:
        value: JSON-shaped Python data (dict with str keys, list, str, int, float, bool,
            None).
        exact: False when `value` may hold a float NaN / Infinity (anything built from a
            `StdlibParsed`): the standard library then writes it and refuses those. msgspec
            would write them as `null`.

    Raises:
        ValueError: a NaN / Infinity (only with `exact=False`, else it is written as null).
        UnicodeEncodeError: a lone surrogate in a string.
        RecursionError: it nests deeper than the interpreter's recursion limit.
        TypeError: a value JSON cannot hold.
    """
    if exact:
        try:
            return _ENCODER.encode(value)
        except (RecursionError, UnicodeEncodeError, TypeError):
            pass  # the standard library's path below raises its own error for the caller
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8")
