"""The JSON nesting bound: the byte-level depth scan agrees with the depth of the decoded value
(the reference: Python's ``json``) for arbitrary JSON, strings full of brackets, quotes and
backslashes included; ``decode_request`` answers a too-deep body with a 400 ``invalid_json``
instead of the decoder's RecursionError."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.frontend.server.errors import APIError
from tidal.frontend.server.json_depth import MAX_JSON_DEPTH, check_json_depth, json_depth
from tidal.frontend.server.openai_protocol import CompletionRequest, decode_request

_TRICKY = st.text(alphabet=st.sampled_from(list('[]{}"\\ab/\u00e9\n')), max_size=12)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TRICKY,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(_TRICKY, children, max_size=4),
    max_leaves=40)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(_JSON, st.booleans())
def test_depth_scan_matches_the_decoded_value(value, ascii_only):
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert json_depth(body) == _depth(json.loads(body))


def test_deep_bodies_are_a_400_not_a_recursion_error():
    for depth in (MAX_JSON_DEPTH + 1, 1000, 100_000):
        body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
        with pytest.raises(APIError) as info:
            decode_request(body, CompletionRequest)
        err = info.value
        assert err.status == 400 and err.code == "invalid_json"
        assert str(MAX_JSON_DEPTH) in err.message
    # Brackets inside a string count for nothing; at the limit the body is decoded (and then
    # found to be the wrong shape for the field, which names it).
    deep_text = "[" * 10_000
    assert decode_request(json.dumps({"prompt": deep_text}).encode(),
                          CompletionRequest).prompt == deep_text
    at_limit = b'{"prompt": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    with pytest.raises(APIError) as info:
        decode_request(at_limit, CompletionRequest)
    assert info.value.code != "invalid_json" and info.value.param.startswith("prompt")


def test_many_shallow_brackets_pass():
    body = json.dumps({"prompt": [[1, 2]] * 5000}).encode()
    check_json_depth(body)
    assert json_depth(body) == 3
