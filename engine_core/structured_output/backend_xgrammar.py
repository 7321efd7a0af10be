"""The xgrammar backend: specs to xgrammar grammars (``to_xgrammar`` needs no tokenizer, so the
frontend validates with it), compiled against the model's tokenizer, one ``GrammarMatcher``
per sequence, and batched bitmask fills (xgrammar's thread pool, the GIL released).

The mask layout is the one every backend shares (backend.py): ``TokenizerInfo`` is built with
the model's vocabulary size, so ids past the tokenizer's length are never allowed, and rows
are ``ceil(vocab / 32)`` int32 words, bit ``t % 32`` of word ``t // 32`` for token ``t``.

Spec forms (see spec.py for which backend gets what): JSON is compact with OpenAI's
separators (``", "``, ``": "``, no free whitespace) like llguidance's; choices are an EBNF
alternation of string literals; GBNF grammars are xgrammar's own EBNF; other grammars are
tried as Lark (xgrammar parses a subset of it); structural tags in vLLM's form become
xgrammar's ``triggered_tags`` format, whose JSON allows at most one whitespace character
between tokens (a weak model cannot pad without end).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, ClassVar

import numpy as np

from tidal.engine_core.config import ModelConfig
from tidal.engine_core.sampling_params import SamplingParamError, StructuredOutputsParams
from tidal.engine_core.structured_output.spec import (
    StructuralTag,
    is_lark,
    parse_structural_tag,
    xgrammar_refusal,
)

logger = logging.getLogger(__name__)

_SEPARATORS = (", ", ": ")
_TAG_WHITESPACE = 1  # whitespace characters allowed between JSON tokens in a structural tag


def to_xgrammar(params: StructuredOutputsParams) -> Any:
    """The ``xgrammar.Grammar`` of ``params``. Raises SamplingParamError naming the field and
    xgrammar's reason (or what xgrammar would not enforce)."""
    import xgrammar as xgr

    kind = params.kind
    param = f"structured_outputs.{kind}"
    refusal = xgrammar_refusal(params)
    if refusal:
        raise SamplingParamError(param, f"cannot be compiled by xgrammar in full: {refusal} "
                                        "(the guidance backend can)")
    try:
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                                separators=_SEPARATORS, strict_mode=False)
        if kind == "json":
            assert params.json is not None
            try:
                schema = json.loads(params.json)
            except ValueError as exc:
                raise SamplingParamError(param, f"is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise SamplingParamError(param, "must be a JSON object (a JSON schema)")
            return xgr.Grammar.from_json_schema(params.json, any_whitespace=False,
                                                separators=_SEPARATORS, strict_mode=False)
        if kind == "regex":
            assert params.regex is not None
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            assert params.choice is not None
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(
                json.dumps(c, ensure_ascii=False) for c in params.choice))
        if kind == "structural_tag":
            assert params.structural_tag is not None
            return xgr.Grammar.from_structural_tag(
                json.dumps(_xgrammar_tag(parse_structural_tag(params.structural_tag))))
        assert params.grammar is not None
        if is_lark(params.grammar):
            return xgr.Grammar.from_lark(params.grammar)
        return xgr.Grammar.from_ebnf(params.grammar)
    except SamplingParamError:
        raise
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and friends
        what = {"grammar": "grammar (GBNF, or the Lark subset xgrammar parses)"}.get(kind, kind)
        raise SamplingParamError(param, f"is not a valid {what} for xgrammar: "
                                        f"{_reason(exc)}") from None


def _xgrammar_tag(tag: StructuralTag | dict[str, Any]) -> dict[str, Any]:
    if isinstance(tag, dict):
        return tag  # xgrammar's own form
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": list(tag.triggers),
        "tags": [{"type": "tag", "begin": s.begin, "end": s.end,
                  "content": {"type": "json_schema", "json_schema": s.schema,
                              "max_whitespace_cnt": _TAG_WHITESPACE}}
                 for s in tag.structures]}}


def _reason(exc: BaseException) -> str:
    # xgrammar prefixes "[hh:mm:ss] /project/cpp/file.cc:line: ": keep the message.
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition(": ")
        if "/" in head or ".cc" in head:
            text = rest
    return text[:1000]


class XgrammarMatcher:
    """One sequence's ``GrammarMatcher`` with llguidance's matcher interface (backend.py)."""

    backend: ClassVar[str] = "xgrammar"
    __slots__ = ("compiled", "matcher", "_stop_ids", "_stopped", "_scratch")

    def __init__(self, compiled: Any, stop_ids: np.ndarray, words: int) -> None:
        import xgrammar as xgr

        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        self._stop_ids = stop_ids
        self._stopped = False
        self._scratch = np.empty((1, words), dtype=np.int32)

    def consume_tokens(self, tokens: list[int]) -> bool:
        m = self.matcher
        for t in tokens:
            if not m.accept_token(t):
                return False
        if m.is_terminated():
            self._stopped = True
        elif m.is_completed() and self._only_stop_allowed():
            # Complete with nothing left but end-of-sequence: stop here, as llguidance does
            # (with ignore_eos the request would otherwise need one more step).
            self._stopped = True
        return True

    def validate_tokens(self, tokens: list[int]) -> int:
        m = self.matcher
        n = 0
        for t in tokens:
            if not m.accept_token(t):  # (a rejected token leaves the state as it was)
                break
            n += 1
        if n:
            m.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)
            # Nothing is ever consumed after a stop: the state rolled back to is not stopped.
            self._stopped = False

    def _only_stop_allowed(self) -> bool:
        row = self._scratch
        self.matcher.fill_next_token_bitmask(row)
        allowed = row[0].copy()
        ids = self._stop_ids
        # (bitwise_and.at: two stop ids in one word, as Qwen's 151643 and 151645, both clear)
        np.bitwise_and.at(allowed, ids // 32, ~(np.int32(1) << (ids % 32).astype(np.int32)))
        return not allowed.any()

    def is_stopped(self) -> bool:
        return self._stopped

    def get_error(self) -> str:
        return "xgrammar rejected the token"

    def deep_copy(self) -> XgrammarMatcher:
        return XgrammarMatcher(self.compiled, self._stop_ids, self._scratch.shape[1])


class XgrammarBackend:
    """Compiles specs against one tokenizer and fills bitmasks for a batch of matchers.
    Built in a compile thread (the tokenizer tables take a fraction of a second)."""

    name = "xgrammar"

    def __init__(self, model: ModelConfig, hf_tokenizer: Any, num_threads: int = 2) -> None:
        import xgrammar as xgr

        start = time.perf_counter()
        self.vocab_size = model.vocab_size
        if len(hf_tokenizer) > self.vocab_size:
            raise ValueError(f"the tokenizer has {len(hf_tokenizer)} tokens, more than the "
                             f"model's vocabulary ({self.vocab_size}): cannot build token masks")
        stop = list(model.eos_token_ids) or None
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=stop)
        self.words = (self.vocab_size + 31) // 32
        self._stop_ids = np.asarray(self.info.stop_token_ids, dtype=np.int64)
        # The manager caches compiled grammars itself.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=num_threads,
                                             cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(num_threads)
        logger.info("xgrammar tokenizer built in %.2f s (%d tokens)",
                    time.perf_counter() - start, self.vocab_size)

    def compile(self, params: StructuredOutputsParams) -> XgrammarMatcher:
        try:
            compiled = self._compiler.compile_grammar(to_xgrammar(params))
        except SamplingParamError as exc:
            raise ValueError(str(exc)) from None
        except RuntimeError as exc:  # xgrammar's own compile errors: auto falls back on them
            raise ValueError(f"xgrammar: {str(exc)[:500]}") from None
        return XgrammarMatcher(compiled, self._stop_ids, self.words)

    def advance(self, steps: list[tuple[XgrammarMatcher, int]]) -> list[bool]:
        """Each matcher of ``steps`` consumes its token; whether each took it."""
        return [m.consume_tokens([token]) for m, token in steps]

    def fill(self, matchers: list[Any], out: np.ndarray) -> None:
        if any(m.matcher.is_terminated() for m in matchers):
            # A matcher advanced by a fill job may have taken end-of-sequence (ignore_eos):
            # xgrammar fills no mask after it. Its row allows the stop tokens alone, as
            # llguidance's does; the engine ends the request before sampling it.
            live = [i for i, m in enumerate(matchers) if not m.matcher.is_terminated()]
            part = np.empty((len(live), out.shape[1]), dtype=np.int32)
            if live:
                self.fill([matchers[i] for i in live], part)
            out.fill(0)
            for t in self._stop_ids.tolist():
                out[:, t // 32] |= np.int32(1) << np.int32(t % 32)
            out[live] = part
            return
        if len(matchers) == 1:
            matchers[0].matcher.fill_next_token_bitmask(out, 0)
            return
        self._batch.batch_fill_next_token_bitmask([m.matcher for m in matchers], out)
