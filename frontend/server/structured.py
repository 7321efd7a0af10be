"""The request forms of structured outputs, to one ``StructuredOutputsParams``.

OpenAI's ``response_format`` (``json_object``, ``json_schema``; ``text`` asks for nothing),
vLLM's ``structured_outputs`` object, and the older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. At most one form per request. The spec is compiled
(without a tokenizer) here, so a bad schema, regex or grammar is a 400 naming the field the
client sent, before anything reaches the engine.
"""

from __future__ import annotations

from typing import Any

from tidal.engine_core.sampling_params import SamplingParamError, StructuredOutputsParams
from tidal.engine_core.structured_output.spec import validate
from tidal.frontend.server.errors import bad_request

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# structured_outputs keys that ask for nothing beyond what is done anyway: there is no
# fallback backend, and JSON is always produced without free whitespace.
_SO_NO_OP = {"disable_fallback", "disable_any_whitespace", "backend"}
_SO_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def structured_params(req: Any) -> StructuredOutputsParams | None:
    """The request's structured-outputs spec (None if it asks for none); 400 on a bad one."""
    forms = []
    rf = req.response_format
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        forms.append("response_format")
    if req.structured_outputs is not None:
        forms.append("structured_outputs")
    forms.extend(name for name in GUIDED if getattr(req, name) is not None)
    if not forms:
        return None
    if len(forms) > 1:
        raise bad_request(f"{forms[1]} cannot be combined with {forms[0]}: give one "
                          "structured-outputs form per request", forms[1])
    form = forms[0]
    if form == "response_format":
        kwargs, param = _response_format(rf)
    elif form == "structured_outputs":
        kwargs, param = _structured_outputs(req.structured_outputs)
    else:
        kwargs, param = _guided(form, getattr(req, form))
    try:
        params = StructuredOutputsParams(**kwargs)
        validate(params)
    except SamplingParamError as exc:
        # The engine's names (structured_outputs.json, ...) become the field the client sent.
        message = str(exc).removeprefix(exc.param).strip()
        raise bad_request(f"{param} {message}"[:2000], param) from None
    return params


def _response_format(rf: Any) -> tuple[dict[str, Any], str]:
    if not isinstance(rf, dict):
        raise bad_request("response_format must be an object such as {\"type\": \"json_object\"}",
                          "response_format")
    kind = rf.get("type")
    if kind == "json_object":
        return {"json_object": True}, "response_format"
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object with a \"schema\"",
                              "response_format.json_schema")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                              "response_format.json_schema.schema")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request("response_format.json_schema.strict must be a boolean",
                              "response_format.json_schema.strict")
        # strict or not, the schema is enforced token by token.
        return {"json": schema}, "response_format.json_schema.schema"
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got "
                      f"{str(kind)[:64]!r}", "response_format.type")


def _structured_outputs(so: Any) -> tuple[dict[str, Any], str]:
    if not isinstance(so, dict):
        raise bad_request("structured_outputs must be an object such as {\"regex\": \"...\"}",
                          "structured_outputs")
    kwargs: dict[str, Any] = {}
    for key, value in so.items():
        if key in _SO_NO_OP or value is None:
            continue
        if key == "structural_tag":
            raise bad_request("structured_outputs.structural_tag is not supported yet",
                              "structured_outputs.structural_tag", code="unsupported_field")
        if key not in _SO_KINDS:
            raise bad_request(f"structured_outputs.{key[:64]} is not supported; give one of "
                              f"{', '.join(_SO_KINDS)}", f"structured_outputs.{key[:64]}",
                              code="unsupported_field")
        if key == "json_object" and value is False:
            continue
        _check_type(f"structured_outputs.{key}", key, value)
        kwargs[key] = value
    if len(kwargs) != 1:
        raise bad_request("structured_outputs needs exactly one of "
                          f"{', '.join(_SO_KINDS)}", "structured_outputs")
    (key,) = kwargs
    return kwargs, f"structured_outputs.{key}"


def _guided(name: str, value: Any) -> tuple[dict[str, Any], str]:
    key = name.removeprefix("guided_")
    _check_type(name, key, value)
    return {key: value}, name


def _check_type(param: str, kind: str, value: Any) -> None:
    ok = {
        "json": isinstance(value, dict | str),
        "json_object": value is True,
        "regex": isinstance(value, str),
        "grammar": isinstance(value, str),
        "choice": isinstance(value, list) and all(isinstance(c, str) for c in value),
    }[kind]
    if not ok:
        want = {"json": "a JSON schema (object or string)", "json_object": "true",
                "regex": "a string", "grammar": "a string",
                "choice": "a list of strings"}[kind]
        raise bad_request(f"{param} must be {want}", param)
