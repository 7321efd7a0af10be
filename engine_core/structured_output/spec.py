"""From a request's ``StructuredOutputsParams`` to a grammar, which backend compiles it, and
its validation (no tokenizer needed: the frontend runs it before a request reaches the engine).

Backends (``--structured-outputs-backend``, or a request's ``structured_outputs.backend``):

- ``guidance`` (llguidance): every kind; grammars in its Lark dialect (GBNF is converted).
- ``xgrammar``: JSON schemas, JSON objects, regexes, choices, GBNF grammars, structural tags
  (both forms below); Lark grammars only in the subset xgrammar parses. JSON schemas that use
  keywords xgrammar does not enforce (``XGRAMMAR_UNENFORCED``) or llguidance's ``x-guidance``
  options are refused (a 400), never half-enforced.
- ``auto`` (the default) picks per request, see ``choose_backend``: llguidance, except for
  structural tags in xgrammar's own ``format`` form, which only xgrammar compiles (measured:
  llguidance compiles in milliseconds where xgrammar takes hundreds, and keeps more of the
  unconstrained throughput).

Structural tags (``structural_tag`` kind; the API for other modules): free text in which every
occurrence of a trigger starts a tagged section that must follow its structure::

    from tidal.engine_core.structured_output.spec import TagStructure, structural_tag_params
    params = structural_tag_params(
        [TagStructure(begin="<tool_call>", schema={...json schema...}, end="</tool_call>")],
        triggers=["<tool_call>"])          # -> StructuredOutputsParams(structural_tag=...)

Each ``begin`` starts with one of the ``triggers``; once the output contains a trigger, the
text that follows must complete one structure that begins with it: the rest of its ``begin``,
JSON valid under its ``schema`` (``True``: any JSON), then its ``end``; then free text again,
any number of times; the output ends at end-of-sequence. ``params.structural_tag`` holds the
JSON text of vLLM's form ``{"type": "structural_tag", "structures": [...], "triggers": [...]}``
(``parse_structural_tag`` reads it back). xgrammar's newer form ``{"type": "structural_tag",
"format": {...}}`` is accepted as well and passed to xgrammar unchanged. On llguidance the
legacy form compiles to a Lark grammar whose trigger is a lazy lexeme (text up to the first
trigger), followed by the structure (``%json`` for the schema).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from tidal.engine_core.sampling_params import SamplingParamError, StructuredOutputsParams

# Rust regex syntax (llguidance's): these are the characters that need a backslash. Python's
# re.escape escapes more (spaces, for one), which Rust rejects.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


# JSON is produced compactly with OpenAI's separators: flexible whitespace lets a model pad
# without end (a weak or random model fills max_tokens with newlines). A schema's own
# "x-guidance" options override these.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

MAX_TAG_STRUCTURES = 128  # structures (and triggers) in one structural tag

# JSON-schema keywords xgrammar 0.2 accepts but does not enforce (checked: it lets through
# instances that violate them; ``_unenforced_keyword`` has two more cases). Under auto these
# schemas go to llguidance; under xgrammar they are refused.
XGRAMMAR_UNENFORCED = frozenset({
    "uniqueItems", "allOf", "oneOf", "not", "if", "then", "else", "dependentRequired",
    "dependentSchemas", "dependencies", "unevaluatedItems", "unevaluatedProperties",
    "contentSchema", "contains", "minContains", "maxContains"})

BACKENDS = ("guidance", "xgrammar")


@dataclass(slots=True, frozen=True)
class TagStructure:
    """One tagged section of a structural tag: ``begin`` JSON(``schema``) ``end``."""

    begin: str
    schema: dict[str, Any] | bool
    end: str


@dataclass(slots=True, frozen=True)
class StructuralTag:
    structures: tuple[TagStructure, ...]
    triggers: tuple[str, ...]


def structural_tag_params(structures: list[TagStructure], triggers: list[str],
                          backend: str | None = None) -> StructuredOutputsParams:
    """The spec of a structural tag (checked: SamplingParamError names what is wrong)."""
    text = json.dumps({"type": "structural_tag",
                       "structures": [{"begin": s.begin, "schema": s.schema, "end": s.end}
                                      for s in structures],
                       "triggers": list(triggers)}, ensure_ascii=False)
    params = StructuredOutputsParams(structural_tag=text, backend=backend)
    parse_structural_tag(text)
    return params


def parse_structural_tag(text: str) -> StructuralTag | dict[str, Any]:
    """vLLM's form as a ``StructuralTag``, or xgrammar's ``format`` form as its dict."""
    param = "structured_outputs.structural_tag"
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise SamplingParamError(param, f"is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise SamplingParamError(param, "must be an object with structures and triggers")
    if obj.get("type", "structural_tag") != "structural_tag":
        raise SamplingParamError(f"{param}.type", "must be \"structural_tag\"")
    if "format" in obj:
        if not isinstance(obj["format"], dict) or set(obj) - {"type", "format"}:
            raise SamplingParamError(param, "in xgrammar's form holds only type and an "
                                            "object format")
        return obj
    extra = set(obj) - {"type", "structures", "triggers"}
    if extra:
        raise SamplingParamError(f"{param}.{sorted(extra)[0][:64]}",
                                 "is not a structural tag field (structures, triggers)")
    triggers = obj.get("triggers")
    if (not isinstance(triggers, list) or not 0 < len(triggers) <= MAX_TAG_STRUCTURES
            or not all(isinstance(t, str) and t for t in triggers)):
        raise SamplingParamError(f"{param}.triggers", f"must be a list of 1 to "
                                 f"{MAX_TAG_STRUCTURES} non-empty strings")
    items = obj.get("structures")
    if not isinstance(items, list) or not 0 < len(items) <= MAX_TAG_STRUCTURES:
        raise SamplingParamError(f"{param}.structures", f"must be a list of 1 to "
                                 f"{MAX_TAG_STRUCTURES} objects (begin, schema, end)")
    structures = []
    for i, item in enumerate(items):
        where = f"{param}.structures[{i}]"
        if not isinstance(item, dict) or set(item) - {"begin", "schema", "end"}:
            raise SamplingParamError(where, "must be an object with begin, schema and end")
        begin, schema, end = item.get("begin"), item.get("schema", True), item.get("end")
        if not isinstance(begin, str) or not begin:
            raise SamplingParamError(f"{where}.begin", "must be a non-empty string")
        if not isinstance(end, str):
            raise SamplingParamError(f"{where}.end", "must be a string")
        if schema is not True and not isinstance(schema, dict):
            raise SamplingParamError(f"{where}.schema", "must be a JSON schema object")
        if not any(begin.startswith(t) for t in triggers):
            raise SamplingParamError(f"{where}.begin", f"{begin[:64]!r} does not start with "
                                     "any of the triggers")
        structures.append(TagStructure(begin, schema, end))
    return StructuralTag(tuple(structures), tuple(triggers))


def escape_regex(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def cache_key(params: StructuredOutputsParams) -> tuple[str, str, str]:
    """(kind, spec text, backend asked for): equal keys compile to the same grammar."""
    kind = params.kind
    backend = params.backend or ""
    if kind == "choice":
        assert params.choice is not None
        return kind, json.dumps(params.choice, ensure_ascii=False), backend
    if kind == "json_object":
        return kind, "", backend
    value = getattr(params, kind)
    assert isinstance(value, str)
    return kind, value, backend


def is_lark(grammar: str) -> bool:
    """GBNF has ``::=`` rules; everything else is taken as Lark."""
    return "::=" not in grammar


@functools.cache
def xgrammar_available() -> bool:
    # Cached: the search walks sys.path (45 us a call on a 2-core VM), and under ``auto`` it
    # ran for every request validated and every grammar compiled.
    return importlib.util.find_spec("xgrammar") is not None


def xgrammar_refusal(params: StructuredOutputsParams) -> str | None:
    """Why xgrammar cannot take ``params`` in full (without parsing it), or None."""
    kind = params.kind
    if kind == "json":
        assert params.json is not None
        try:
            schema = json.loads(params.json)
        except (ValueError, RecursionError):
            return None  # the parse reports it
        found = _unenforced_keyword(schema)
        if found:
            return f"the JSON schema uses {found!r} in a way xgrammar does not enforce"
    if kind == "structural_tag":
        assert params.structural_tag is not None
        try:
            tag = parse_structural_tag(params.structural_tag)
        except SamplingParamError:
            return None
        if isinstance(tag, StructuralTag):
            for s in tag.structures:
                found = _unenforced_keyword(s.schema)
                if found:
                    return f"a structure's schema uses {found!r} in a way xgrammar does " \
                           "not enforce"
    return None


def _unenforced_keyword(node: Any, depth: int = 0) -> str | None:
    if depth > 64:
        return "a nesting deeper than 64 levels"  # not checked further: llguidance takes it
    if isinstance(node, dict):
        # Also let through: "required" names with no "properties" beside them, and an anyOf
        # next to a "type" of its own.
        if "required" in node and not node.get("properties"):
            return "required"
        if "anyOf" in node and "type" in node:
            return "anyOf"
        # xgrammar drops a string's length bounds next to a pattern or format, and a
        # multipleOf that is not an integer's integer step.
        if ("pattern" in node or "format" in node) and ("minLength" in node
                                                        or "maxLength" in node):
            return "pattern" if "pattern" in node else "format"
        step = node.get("multipleOf")
        if step is not None and not (type(step) is int and node.get("type") == "integer"):
            return "multipleOf"
        for key, value in node.items():
            if key in XGRAMMAR_UNENFORCED or key == "x-guidance":
                return key
            # "properties" / "$defs" map names to schemas: a property may be named "not".
            children = value.values() if key in ("properties", "$defs", "definitions",
                                                 "patternProperties") and \
                isinstance(value, dict) else [value]
            for child in children:
                found = _unenforced_keyword(child, depth + 1)
                if found:
                    return found
    elif isinstance(node, list):
        for child in node:
            found = _unenforced_keyword(child, depth + 1)
            if found:
                return found
    return None


def choose_backend(params: StructuredOutputsParams, configured: str,
                   has_xgrammar: bool | None = None) -> tuple[str, str]:
    """(backend, why) for ``params`` on an engine started with ``configured`` (auto |
    guidance | xgrammar). The request's own ``backend`` wins (``validate`` checked it)."""
    if params.backend is not None:
        return params.backend, "the request asked for it"
    if configured != "auto":
        return configured, "--structured-outputs-backend"
    if has_xgrammar is None:
        has_xgrammar = xgrammar_available()
    if not has_xgrammar:
        return "guidance", "xgrammar is not installed"
    if params.kind == "structural_tag" and isinstance(
            parse_structural_tag(params.structural_tag or ""), dict):
        return "xgrammar", "a structural tag in xgrammar's format form"
    # Measured side by side (H100, Qwen3-0.6B shape, tools/bench_structured.py, batch 256
    # under one JSON schema; 100 corpus schemas for the first mask): llguidance kept 0.81 of
    # unconstrained throughput against 0.76, its first masks came after 41 ms p99 against
    # 733, and it enforces 32 of the schemas xgrammar would let through in part.
    return "guidance", "llguidance compiles every other kind, faster"


def to_grammar(params: StructuredOutputsParams,
               special_tokens: Mapping[str, int] | None = None) -> str:
    """The llguidance grammar of ``params``. Raises SamplingParamError when the spec is not
    even well-formed (a JSON schema that is not JSON); ``validate`` checks the rest.
    ``special_tokens`` (text -> id; the compiling backend knows them) lets a structural tag's
    markers match those tokens too (``structural_tag_lark``)."""
    from llguidance import LLMatcher

    kind = params.kind
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "json":
        assert isinstance(params.json, str)
        try:
            schema = json.loads(params.json)
        except (ValueError, RecursionError) as exc:
            raise SamplingParamError("structured_outputs.json",
                                     f"is not valid JSON: {str(exc)[:200]}") from None
        if not isinstance(schema, dict | bool):
            raise SamplingParamError("structured_outputs.json",
                                     "must be a JSON object (a JSON schema)")
        if schema is False:
            raise SamplingParamError("structured_outputs.json",
                                     "is false: a schema that no value satisfies")
        # (The schema true allows any value, as {} does; llguidance takes only objects.)
        text = "{}" if schema is True else params.json
        try:
            return LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise SamplingParamError("structured_outputs.json",
                                     f"is not a valid JSON schema: {str(exc)[:1000]}") from None
    if kind == "regex":
        assert params.regex is not None
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        assert params.choice is not None
        return LLMatcher.grammar_from_regex(
            "(" + "|".join(escape_regex(c) for c in params.choice) + ")")
    if kind == "structural_tag":
        assert params.structural_tag is not None
        tag = parse_structural_tag(params.structural_tag)
        if not isinstance(tag, StructuralTag):
            raise SamplingParamError("structured_outputs.structural_tag",
                                     "in xgrammar's format form needs the xgrammar backend; "
                                     "give structures and triggers for llguidance")
        return LLMatcher.grammar_from_lark(structural_tag_lark(tag, special_tokens))
    assert params.grammar is not None
    text = params.grammar
    if not is_lark(text):  # GBNF (llama.cpp's EBNF dialect): llguidance converts it to Lark
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            text = any_to_lark(text)
        except Exception as exc:  # noqa: BLE001 - any conversion failure is the user's input
            raise SamplingParamError("structured_outputs.grammar",
                                     f"is not a valid GBNF grammar: {exc}") from None
    return LLMatcher.grammar_from_lark(text)


def structural_tag_lark(tag: StructuralTag,
                        special_tokens: Mapping[str, int] | None = None) -> str:
    """llguidance's Lark grammar of a structural tag. Per trigger, a lazy rule matches the
    free text up to and including the trigger's first occurrence (lazy: the lexeme ends
    there, so a trigger can never pass as free text); the structures beginning with that
    trigger follow it.

    llguidance matches a special token (``tokenizer.is_special_token``) only through its own
    syntax, never as text: a model emitting Qwen's single ``<tool_call>`` token would be
    refused by a text trigger. So a trigger that is the text of one of ``special_tokens``
    also opens its section as that token (``<[id]>``; free text cannot hold a special token,
    so the text before it ends there), and such texts inside a begin or end match either
    form."""
    specials = _specials_in(tag, special_tokens or {})
    alternatives: list[str] = []
    rules: list[str] = []
    for i, trigger in enumerate(tag.triggers):
        bodies = []
        for s in tag.structures:
            # The longest trigger that begins the structure owns it (a trigger may prefix
            # another one).
            owner = max((t for t in tag.triggers if s.begin.startswith(t)), key=len)
            if owner != trigger:
                continue
            schema: Any = {} if s.schema is True else dict(s.schema)
            schema.setdefault("x-guidance", _JSON_OPTIONS)
            parts = [_lark_text(s.begin[len(trigger):], specials),
                     "%json " + json.dumps(schema), _lark_text(s.end, specials)]
            bodies.append(" ".join(p for p in parts if p))
        if not bodies:
            continue
        rules.append(f"trigger_{i}[lazy]: /(.|\\n)*/ {_lark_str(trigger)}")
        rules.append(f"body_{i}: " + " | ".join(f"({b})" for b in bodies))
        rules.append(f"tag_{i}: trigger_{i} body_{i}")
        alternatives.append(f"tag_{i}")
        token = specials.get(trigger)
        if token is not None:
            rules.append(f"token_tag_{i}: TEXT <[{token}]> body_{i}")
            alternatives.append(f"token_tag_{i}")
    lines = ["%llguidance {}", "start: (" + " | ".join(alternatives) + ")* TEXT",
             r"TEXT: /(.|\n)*/", *rules]
    return "\n".join(lines) + "\n"


def _specials_in(tag: StructuralTag, special_tokens: Mapping[str, int]) -> dict[str, int]:
    """The special tokens whose text appears in a trigger, begin or end (a Llama 3 tokenizer
    has hundreds: only these few go into the grammar)."""
    texts = [*tag.triggers, *(s.begin for s in tag.structures), *(s.end for s in tag.structures)]
    return {t: i for t, i in special_tokens.items() if t and any(t in x for x in texts)}


def _lark_text(text: str, specials: Mapping[str, int]) -> str:
    """``text`` as Lark: a string literal, where each special token's text may also be that
    token."""
    if not specials or not text:
        return _lark_str(text)
    pattern = "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))
    parts = []
    for piece in re.split(f"({pattern})", text):
        if piece in specials:
            parts.append(f"({_lark_str(piece)} | <[{specials[piece]}]>)")
        elif piece:
            parts.append(_lark_str(piece))
    return " ".join(parts)


def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else ""


# Verdicts of ``validate`` by digest of (spec, backend): an error's (param, message), or None
# for a spec that compiles. Clients send the same schema with every request of a conversation
# (and the API server checks a request's spec twice: when it parses the request, and with the
# engine's own request checks), so the compile is done once; only digests are kept.
_VERDICTS: OrderedDict[bytes, tuple[str, str] | None] = OrderedDict()
_MAX_VERDICTS = 4096
_VERDICTS_LOCK = threading.Lock()  # (API servers check grammars on worker threads)


def validate(params: StructuredOutputsParams, backend: str = "auto") -> None:
    """Check that ``params`` compiles with the backend an engine started with ``backend``
    would use (``choose_backend``). Raises SamplingParamError naming the field
    (``structured_outputs.<kind>``) and the backend's reason. The verdict is kept (by the
    spec's digest) for the next request with the same spec."""
    key = hashlib.sha256(msgspec.msgpack.encode(params) + b"\0" + backend.encode()).digest()
    with _VERDICTS_LOCK:
        known = key in _VERDICTS
        verdict = _VERDICTS.get(key)
        if known:
            _VERDICTS.move_to_end(key)
    if known:
        if verdict is not None:
            raise SamplingParamError(*verdict)
        return
    try:
        _validate(params, backend)
    except SamplingParamError as exc:
        _keep(key, (exc.param, str(exc).removeprefix(exc.param).removeprefix(" ")))
        raise
    # (Anything else it raises is no verdict: the next request with this spec checks again.)
    _keep(key, None)


def _keep(key: bytes, verdict: tuple[str, str] | None) -> None:
    with _VERDICTS_LOCK:
        _VERDICTS[key] = verdict
        while len(_VERDICTS) > _MAX_VERDICTS:
            _VERDICTS.popitem(last=False)


def _validate(params: StructuredOutputsParams, backend: str) -> None:
    if params.backend is not None and backend != "auto" and params.backend != backend:
        raise SamplingParamError("structured_outputs.backend",
                                 f"{params.backend!r} is not this server's grammar backend "
                                 f"({backend}; start it with --structured-outputs-backend "
                                 "auto to choose per request)")
    if params.backend == "xgrammar" or (params.backend is None and backend == "xgrammar"):
        if not xgrammar_available():
            raise SamplingParamError("structured_outputs.backend",
                                     "xgrammar is not installed (pip install xgrammar)")
        _validate_xgrammar(params)
        return
    name, _ = choose_backend(params, backend)
    if name == "xgrammar":
        try:
            _validate_xgrammar(params)
            return
        except SamplingParamError:
            if params.kind == "structural_tag" and not isinstance(
                    parse_structural_tag(params.structural_tag or ""), StructuralTag):
                raise  # xgrammar's own form: there is no fallback
            # auto falls back to llguidance (the engine does the same when compiling).
    _validate_guidance(params)


def _validate_guidance(params: StructuredOutputsParams) -> None:
    from llguidance import LLMatcher

    grammar = to_grammar(params)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        kind = params.kind
        raise SamplingParamError(f"structured_outputs.{kind}",
                                 f"is not a valid {_WHAT[kind]}: {error.strip()[:1000]}")


def _validate_xgrammar(params: StructuredOutputsParams) -> None:
    from tidal.engine_core.structured_output.backend_xgrammar import to_xgrammar

    to_xgrammar(params)


_WHAT = {"json": "JSON schema", "json_object": "JSON object spec", "regex": "regular expression",
         "choice": "choice list", "grammar": "Lark grammar", "structural_tag": "structural tag"}
