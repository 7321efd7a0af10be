"""The request forms of structured outputs, to one ``StructuredOutputsParams``.

OpenAI's ``response_format`` (``json_object``, ``json_schema``; ``text`` asks for nothing),
vLLM's ``structured_outputs`` object, and the older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. At most one form per request. The spec is compiled
(without a tokenizer) here, so a bad schema, regex or grammar is a 400 naming the field the
client sent, before anything reaches the engine.

Structural tags (engine_core/structured_output/spec.py) come as vLLM's ``response_format``
``{"type": "structural_tag", "structures": [...], "triggers": [...]}`` (or xgrammar's
``{"type": "structural_tag", "format": {...}}``), or as ``structured_outputs.structural_tag``
(that object, or its JSON text). ``structured_outputs.backend`` picks the grammar backend for
the request (auto, guidance / llguidance, xgrammar); the engine refuses one it was not started
to use (a 400 from the request's validation).
"""

from __future__ import annotations

import json
from typing import Any

from tidal.engine_core.sampling_params import SamplingParamError, StructuredOutputsParams
from tidal.engine_core.structured_output.spec import validate
from tidal.frontend.server.errors import bad_request

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# structured_outputs keys that ask for nothing beyond what is done anyway: JSON is always
# produced without free whitespace.
_SO_NO_OP = {"disable_any_whitespace"}
_SO_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
_SO_BACKENDS = {"auto": None, "guidance": "guidance", "llguidance": "guidance",
                "xgrammar": "xgrammar"}


def requested_forms(req: Any) -> list[str]:
    """The structured-outputs fields the request sets (``response_format`` "text" asks for
    nothing)."""
    forms = []
    rf = req.response_format
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        forms.append("response_format")
    if req.structured_outputs is not None:
        forms.append("structured_outputs")
    forms.extend(name for name in GUIDED if getattr(req, name) is not None)
    return forms


def structured_params(req: Any) -> StructuredOutputsParams | None:
    """The request's structured-outputs spec (None if it asks for none); 400 on a bad one."""
    forms = requested_forms(req)
    rf = req.response_format
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
        # The engine's names (structured_outputs.json, ...) become the field the client sent;
        # a part of it (structural_tag.structures[0].begin) stays named under it.
        message = str(exc).removeprefix(exc.param).strip()
        engine_name = f"structured_outputs.{_kind(kwargs)}"
        if exc.param.startswith(engine_name):
            param += exc.param[len(engine_name):]
        elif exc.param == "structured_outputs.backend":
            param = exc.param
        raise bad_request(f"{param} {message}"[:2000], param) from None
    return params


def _kind(kwargs: dict[str, Any]) -> str:
    return next((k for k in kwargs if k in _SO_KINDS), "json")


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
    if kind == "structural_tag":
        return {"structural_tag": _json_text(rf)}, "response_format"
    raise bad_request(f"response_format.type must be text, json_object, json_schema or "
                      f"structural_tag, got {str(kind)[:64]!r}", "response_format.type")


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _structured_outputs(so: Any) -> tuple[dict[str, Any], str]:
    if not isinstance(so, dict):
        raise bad_request("structured_outputs must be an object such as {\"regex\": \"...\"}",
                          "structured_outputs")
    kwargs: dict[str, Any] = {}
    backend = so.get("backend")
    if backend is not None and (not isinstance(backend, str) or backend not in _SO_BACKENDS):
        raise bad_request("structured_outputs.backend must be auto, guidance (llguidance) or "
                          f"xgrammar, got {str(backend)[:64]!r}", "structured_outputs.backend")
    if so.get("disable_fallback") and _SO_BACKENDS.get(backend) is None:
        # auto may compile a spec xgrammar rejects with llguidance instead.
        raise bad_request("structured_outputs.disable_fallback needs structured_outputs."
                          "backend (guidance or xgrammar): auto falls back from xgrammar to "
                          "llguidance", "structured_outputs.disable_fallback")
    for key, value in so.items():
        if key in _SO_NO_OP or key in ("backend", "disable_fallback") or value is None:
            continue
        if key not in _SO_KINDS:
            raise bad_request(f"structured_outputs.{key[:64]} is not supported; give one of "
                              f"{', '.join(_SO_KINDS)}", f"structured_outputs.{key[:64]}",
                              code="unsupported_field")
        if key == "json_object" and value is False:
            continue
        _check_type(f"structured_outputs.{key}", key, value)
        kwargs[key] = _json_text(value) if key == "structural_tag" else value
    if len(kwargs) != 1:
        raise bad_request("structured_outputs needs exactly one of "
                          f"{', '.join(_SO_KINDS)}", "structured_outputs")
    (key,) = kwargs
    if _SO_BACKENDS.get(backend) is not None:
        kwargs["backend"] = _SO_BACKENDS[backend]
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
        "structural_tag": isinstance(value, dict | str),
    }[kind]
    if not ok:
        want = {"json": "a JSON schema (object or string)", "json_object": "true",
                "regex": "a string", "grammar": "a string",
                "choice": "a list of strings",
                "structural_tag": "an object with structures and triggers (or its JSON "
                                  "text)"}[kind]
        raise bad_request(f"{param} must be {want}", param)
