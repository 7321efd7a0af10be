"""A bound on how deeply a JSON request body nests arrays and objects, checked before decoding.

The decoder recurses once per level: ``[[[[...]]]]`` a thousand deep raised ``RecursionError``
(a 500) instead of a 400. No request of this API needs more than a handful of levels (a chat
message's content parts are four deep; a JSON schema a dozen or so), so a body deeper than
``MAX_JSON_DEPTH`` is refused.

The check runs on the raw bytes, at C speed (a few milliseconds a MiB, whatever the content):
escaped backslashes and then escaped quotes are dropped, so every quote left opens or closes a
string; everything but brackets and quotes is deleted; brackets after an odd number of quotes
are inside a string and count for nothing; the depth is the largest running sum of +1 per
opening and -1 per closing bracket. A body with no more brackets in all than the limit skips
even that.
"""

from __future__ import annotations

import numpy as np

from tidal.frontend.server.errors import bad_request

MAX_JSON_DEPTH = 64

_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_QUOTE = ord('"')


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in ``body`` (for invalid JSON: at least as
    deep as a decoder would go before failing)."""
    # Outside strings a backslash is invalid JSON anyway, so dropping pairs left to right
    # matches how a decoder reads escapes.
    skeleton = (body.replace(b"\\\\", b"").replace(b'\\"', b"")
                .translate(None, _NOT_STRUCTURE))
    if not skeleton:
        return 0
    chars = np.frombuffer(skeleton, dtype=np.uint8)
    steps = _STEP[chars]
    quotes = chars == _QUOTE
    if quotes.any():
        steps *= (np.cumsum(quotes, dtype=np.int32) & 1) == 0
    return max(0, int(np.cumsum(steps, dtype=np.int32).max()))


def check_json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise a 400 (``invalid_json``) if ``body`` nests deeper than ``limit``."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return
    depth = json_depth(body)
    if depth > limit:
        raise bad_request(f"the request body nests JSON arrays and objects {depth} levels deep; "
                          f"the limit is {limit}", code="invalid_json")
