"""``spec.validate`` keeps its verdicts by the spec's digest: a spec checked again (the API
server checks each request's twice; clients resend a conversation's schema every turn) is not
compiled again, an error comes back the same, the backend is part of the key, and the kept
verdicts are bounded (least recently used out first)."""

from __future__ import annotations

import uuid

import pytest

from tidal.engine_core.sampling_params import SamplingParamError, StructuredOutputsParams
from tidal.engine_core.structured_output import spec


@pytest.fixture
def compiles(monkeypatch):
    seen: list[str] = []
    real = spec._validate

    def counted(params, backend):
        seen.append(f"{params.regex or params.json}|{backend}")
        real(params, backend)

    monkeypatch.setattr(spec, "_validate", counted)
    return seen


def _unique(pattern: str) -> str:
    return f"{pattern}{uuid.uuid4().hex}"  # (verdicts are kept for the process)


def test_a_spec_checked_again_is_not_compiled_again(compiles):
    params = StructuredOutputsParams(regex=_unique("[a-z]+"))
    spec.validate(params)
    spec.validate(StructuredOutputsParams(regex=params.regex))  # an equal spec, a new object
    assert len(compiles) == 1
    spec.validate(params, "guidance")  # another backend: another verdict
    assert len(compiles) == 2


def test_an_error_comes_back_the_same_without_a_compile(compiles):
    params = StructuredOutputsParams(regex=_unique("(unclosed"))
    errors = []
    for _ in range(2):
        with pytest.raises(SamplingParamError) as info:
            spec.validate(params)
        errors.append((info.value.param, str(info.value)))
    assert len(compiles) == 1
    assert errors[0] == errors[1]
    assert errors[0][0] == "structured_outputs.regex"
    assert "is not a valid regular expression" in errors[0][1]


def test_kept_verdicts_are_bounded(compiles, monkeypatch):
    monkeypatch.setattr(spec, "_MAX_VERDICTS", 2)
    monkeypatch.setattr(spec, "_VERDICTS", type(spec._VERDICTS)())
    a, b, c = (StructuredOutputsParams(regex=_unique(p)) for p in ("a", "b", "c"))
    for p in (a, b, a, c):  # a used again: b is the least recently used when c comes
        spec.validate(p)
    assert len(compiles) == 3
    spec.validate(a)
    assert len(compiles) == 3
    spec.validate(b)  # evicted: compiled again
    assert len(compiles) == 4
    assert len(spec._VERDICTS) <= 2


def test_an_unexpected_failure_is_no_verdict(monkeypatch):
    """A check that fails in some other way than a bad spec (a backend's own error) keeps
    nothing: the next request with the spec is checked again, not waved through."""
    calls = []

    def broken(params, backend):
        calls.append(1)
        raise RuntimeError("backend failure")

    monkeypatch.setattr(spec, "_validate", broken)
    params = StructuredOutputsParams(regex=_unique("x"))
    for _ in range(2):
        with pytest.raises(RuntimeError):
            spec.validate(params)
    assert len(calls) == 2


def test_boolean_schemas():
    """The schema true allows any value (as {}); false allows none: a 400-worthy error naming
    the field, not a backend's ValueError (which was a 500)."""
    spec.validate(StructuredOutputsParams(json="true"))
    assert spec.to_grammar(StructuredOutputsParams(json="true"))
    with pytest.raises(SamplingParamError, match="no value satisfies") as info:
        spec.validate(StructuredOutputsParams(json="false"))
    assert info.value.param == "structured_outputs.json"
