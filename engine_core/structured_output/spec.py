"""From a request's ``StructuredOutputsParams`` to an llguidance grammar, and its validation
(no tokenizer needed: the frontend runs it before a request reaches the engine)."""

from __future__ import annotations

import json

from tidal.engine_core.sampling_params import SamplingParamError, StructuredOutputsParams

# Rust regex syntax (llguidance's): these are the characters that need a backslash. Python's
# re.escape escapes more (spaces, for one), which Rust rejects.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


# JSON is produced compactly with OpenAI's separators: flexible whitespace lets a model pad
# without end (a weak or random model fills max_tokens with newlines). A schema's own
# "x-guidance" options override these.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def escape_regex(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def cache_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, spec text): equal keys compile to the same grammar."""
    kind = params.kind
    if kind == "choice":
        assert params.choice is not None
        return kind, json.dumps(params.choice, ensure_ascii=False)
    if kind == "json_object":
        return kind, ""
    value = getattr(params, kind)
    assert isinstance(value, str)
    return kind, value


def to_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params``. Raises SamplingParamError when the spec is not
    even well-formed (a JSON schema that is not JSON); ``validate`` checks the rest."""
    from llguidance import LLMatcher

    kind = params.kind
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "json":
        assert isinstance(params.json, str)
        try:
            schema = json.loads(params.json)
        except ValueError as exc:
            raise SamplingParamError("structured_outputs.json",
                                     f"is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise SamplingParamError("structured_outputs.json",
                                     "must be a JSON object (a JSON schema)")
        return LLMatcher.grammar_from_json_schema(params.json, defaults=_JSON_OPTIONS)
    if kind == "regex":
        assert params.regex is not None
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        assert params.choice is not None
        return LLMatcher.grammar_from_regex(
            "(" + "|".join(escape_regex(c) for c in params.choice) + ")")
    assert params.grammar is not None
    text = params.grammar
    if "::=" in text:  # GBNF (llama.cpp's EBNF dialect): llguidance converts it to Lark
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            text = any_to_lark(text)
        except Exception as exc:  # noqa: BLE001 - any conversion failure is the user's input
            raise SamplingParamError("structured_outputs.grammar",
                                     f"is not a valid GBNF grammar: {exc}") from None
    return LLMatcher.grammar_from_lark(text)


def validate(params: StructuredOutputsParams) -> str:
    """Check that ``params`` compiles; returns its grammar. Raises SamplingParamError naming
    the field (``structured_outputs.<kind>``) and llguidance's reason."""
    from llguidance import LLMatcher

    grammar = to_grammar(params)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        kind = params.kind
        raise SamplingParamError(f"structured_outputs.{kind}",
                                 f"is not a valid {_WHAT[kind]}: {error.strip()[:1000]}")
    return grammar


_WHAT = {"json": "JSON schema", "json_object": "JSON object spec", "regex": "regular expression",
         "choice": "choice list", "grammar": "Lark grammar"}
