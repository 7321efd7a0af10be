"""The llguidance backend's compile: the template comes back with its first mask computed
(llguidance builds its lexer lazily, so that finishes the compile in the compile thread), the
mask is the grammar's own, and a grammar that fails on its first mask fails the compile."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.sampling_params import StructuredOutputsParams
from tidal.engine_core.structured_output.backend_guidance import GuidanceBackend
from tidal.engine_core.structured_output.spec import to_grammar

llguidance = pytest.importorskip("llguidance", reason="llguidance is not installed")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


class _Recorder:
    """A real matcher that counts its mask computations (and, with ``fail``, turns into an
    error state on the first, as a grammar past llguidance's limits does)."""

    real = llguidance.LLMatcher
    grammar_from_json_schema = staticmethod(real.grammar_from_json_schema)  # (to_grammar's)
    fail = False

    def __init__(self, tokenizer, grammar, log_level=0):
        self.inner = self.real(tokenizer, grammar, log_level=log_level)
        self.masks = 0

    def is_error(self):
        return self.fail and self.masks > 0 or self.inner.is_error()

    def get_error(self):
        return "lexer too complex" if self.fail else self.inner.get_error()

    def unsafe_compute_mask_ptr(self, ptr, size):
        self.masks += 1
        self.inner.unsafe_compute_mask_ptr(ptr, size)


@pytest.fixture(scope="module")
def backend(tiny_qwen3):
    return GuidanceBackend(EngineArgs(model=str(tiny_qwen3)).create_config().model)


def test_compile_computes_the_first_mask_and_leaves_the_matcher_at_the_start(
        backend, monkeypatch):
    params = StructuredOutputsParams(json=SCHEMA)
    monkeypatch.setattr(llguidance, "LLMatcher", _Recorder)
    template = backend.compile(params)
    assert template.masks == 1  # computed in the compile, before any request fills
    monkeypatch.undo()
    # The template (and so its copies) still gives the grammar's start mask.
    got = np.empty((1, backend.words), dtype=np.int32)
    backend.fill([template.inner], got)
    fresh = llguidance.LLMatcher(backend.tokenizer, to_grammar(params), log_level=0)
    want = np.empty((1, backend.words), dtype=np.int32)
    backend.fill([fresh], want)
    np.testing.assert_array_equal(got, want)
    allowed = {i for i in range(backend.vocab_size) if got[0, i // 32] >> (i % 32) & 1}
    assert allowed and all(fresh.validate_tokens([t]) == 1 for t in list(allowed)[:50])
    assert template.inner.consume_tokens(
        backend.tokenizer.tokenize_str(json.dumps({"n": 7})))


class _Failing(_Recorder):
    fail = True


def test_a_grammar_failing_on_its_first_mask_fails_its_compile(backend, monkeypatch):
    monkeypatch.setattr(llguidance, "LLMatcher", _Failing)
    with pytest.raises(ValueError, match="lexer too complex"):
        backend.compile(StructuredOutputsParams(json=SCHEMA))
