"""The llguidance backend: the model's tokenizer as an ``LLTokenizer``, one ``LLMatcher`` per
constrained sequence, and batched next-token bitmask fills (llguidance's own thread pool, the
GIL released)."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from tidal.engine_core import envs
from tidal.engine_core.config import ModelConfig
from tidal.engine_core.gguf_tokenizer import load_gguf_tokenizer
from tidal.engine_core.sampling_params import StructuredOutputsParams
from tidal.engine_core.structured_output.spec import to_grammar

logger = logging.getLogger(__name__)


def load_hf_tokenizer(model: ModelConfig) -> Any:
    """The model's HF tokenizer (an HF folder, or rebuilt from a GGUF file's metadata). The
    frontend loads its own copy; the engine needs one only once a constrained request comes."""
    from transformers import AutoTokenizer

    path = model.tokenizer
    if path.endswith(".gguf"):
        # The frontend's cached rebuild, when it made one (seconds saved).
        return load_gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


class GuidanceBackend:
    """Compiles grammars against one tokenizer and fills bitmasks for a batch of matchers.
    Built in a compile thread (building the tokenizer tables takes about a second)."""

    name = "guidance"

    def __init__(self, model: ModelConfig, hf: Any = None) -> None:
        import llguidance
        import llguidance.hf

        start = time.perf_counter()
        if hf is None:
            hf = load_hf_tokenizer(model)
        self.vocab_size = model.vocab_size  # the logits' width: the mask covers every id
        if len(hf) > self.vocab_size:
            raise ValueError(f"the tokenizer has {len(hf)} tokens, more than the model's "
                             f"vocabulary ({self.vocab_size}): cannot build token masks")
        eos = list(model.eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
        self.words = (self.vocab_size + 31) // 32
        # Added tokens llguidance takes as special (matched only by id, never as text), for
        # the markers of structural tags (spec.structural_tag_lark).
        self.special_tokens = {text: i for text, i in hf.get_added_vocab().items()
                               if i < self.vocab_size and self.tokenizer.is_special_token(i)}
        self._executor = llguidance.LLExecutor(num_threads=envs.grammar_fill_threads())
        # Matchers advance on the fill's threads too. (Copies of one template contend on their
        # shared state; with the manager's templates per grammar, 256 tokens of a step took
        # 0.42 ms on 12 threads against 0.92 ms on one, H100 host.)
        self._advancer = (self._executor if envs.grammar_advance_parallel()
                          else llguidance.LLExecutor(num_threads=1))
        logger.info("llguidance tokenizer built in %.2f s (%d tokens)",
                    time.perf_counter() - start, self.vocab_size)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """A matcher at the grammar's start, its first mask computed once (the compile cache
        keeps it as a template and hands out copies). Raises ValueError with llguidance's
        reason if it does not compile.

        llguidance builds a grammar's lexer lazily, so the first mask finishes the compile
        (llguidance's own "time to first mask"). Done here, in the compile thread, it is not
        left to the fill of the request's first step, and the template's copies share
        what it built."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, to_grammar(params, self.special_tokens),
                                       log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        scratch = np.empty(self.words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if matcher.is_error():  # (e.g. past llguidance's lexer limits: fail it now, alone)
            raise ValueError(matcher.get_error())
        return matcher

    def advance(self, steps: list[tuple[Any, int]]) -> list[bool]:
        """Each matcher of ``steps`` consumes its token, in one call (the GIL released);
        whether each took it. A matcher that stopped or refused it still fills a mask
        (end-of-sequence alone)."""
        if len(steps) == 1:
            m, token = steps[0]
            return [m.consume_token(token)]
        return self._advancer.consume_token_par(steps)

    def fill(self, matchers: list[Any], out: np.ndarray) -> None:
        """Row i of ``out`` (int32 [len(matchers), words]) = matchers[i]'s next-token mask."""
        if len(matchers) == 1:
            m = matchers[0]
            m.unsafe_compute_mask_ptr(out.ctypes.data, out.shape[1] * 4)
            return
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], out.ctypes.data, out.shape[1] * 4,
            out.shape[0])
