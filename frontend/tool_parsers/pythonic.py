"""Pythonic tool calls: the output is a Python list of calls, ``[f(a=1), g(b="x")]``
(Llama 3.2 / 4 and others), keyword arguments of literal values."""

from __future__ import annotations

import ast
import json
import warnings
from typing import Any

from tidal.frontend.tool_parsers.base import Piece, ScanState, ToolCall, ToolParser, make_call


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def parse_pythonic(source: str) -> list[ToolCall] | None:
    """The calls of ``[f(a=1), ...]``; None unless every element is a call of a (dotted) name
    with keyword arguments whose values are JSON-able literals."""
    try:
        with warnings.catch_warnings():  # a model's bad escapes ("\\{") are not our warnings
            warnings.simplefilter("ignore")
            tree = ast.parse(source.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _name(node.func)
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
                json.dumps(args[kw.arg])  # sets, bytes, complex numbers have no JSON form
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        call = make_call(name, args)
        if call is None:
            return None
        calls.append(call)
    return calls


class PythonicToolParser(ToolParser):
    """An output that opens with ``[`` is a call list up to its closing bracket; anything else
    (and text after the list) is content."""

    name = "pythonic"

    def _scan(self, st: ScanState, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        text = st.text
        if st.mode == "text":
            rest = text.lstrip()
            if not rest and not final:
                return pieces
            st.mode = "calls" if rest.startswith("[") else "after"
            st.pos = len(text) - len(rest) if st.mode == "calls" else 0
        if st.mode == "calls":
            j = st.bracket_end(st.pos, python=True)
            if j is None:
                if not final:
                    return pieces
                j = len(text)
            pieces.append(self._section(text[st.pos:j], parse_pythonic(text[st.pos:j])))
            st.pos = j
            st.mode = "after"
        if st.pos < len(text):
            pieces.append(text[st.pos:])
            st.pos = len(text)
        return pieces
