"""The grammar backends of one engine behind the one backend interface (backend.py): each
spec goes to the backend ``spec.choose_backend`` picks (logged at debug level with why), and a
step's mask fill goes to each backend for its own matchers' rows.

Backends are built on first use, in a compile thread, from one shared HF tokenizer. Under
``auto`` a spec xgrammar fails to compile is compiled by llguidance instead (the frontend's
validation did the same, so it was accepted); a structural tag in xgrammar's own form has no
such fallback.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

import numpy as np

from tidal.engine_core.config import ModelConfig
from tidal.engine_core.sampling_params import StructuredOutputsParams
from tidal.engine_core.structured_output import spec
from tidal.engine_core.structured_output.backend import GrammarBackend, Matcher

logger = logging.getLogger(__name__)


class BackendRouter:
    def __init__(self, model: ModelConfig, configured: str, num_threads: int = 2) -> None:
        self.model = model
        self.configured = configured  # auto | guidance | xgrammar
        self.vocab_size = model.vocab_size
        self.words = (model.vocab_size + 31) // 32
        self._num_threads = num_threads
        self._backends: dict[str, GrammarBackend] = {}
        # The backend while it is the only one built: every matcher is then its own, and a
        # step's fill skips sorting them out (Python on the fill thread, under the GIL).
        self._only: GrammarBackend | None = None
        self._hf: Any = None
        self._lock = threading.Lock()
        self.compiled_by = Counter[str]()  # backend -> specs compiled (the benchmark, tests)

    def backend(self, name: str) -> GrammarBackend:
        with self._lock:
            found = self._backends.get(name)
            if found is not None:
                return found
            from tidal.engine_core.structured_output.backend_guidance import load_hf_tokenizer

            if self._hf is None:
                self._hf = load_hf_tokenizer(self.model)
            if name == "xgrammar":
                from tidal.engine_core.structured_output.backend_xgrammar import XgrammarBackend

                made: GrammarBackend = XgrammarBackend(self.model, self._hf, self._num_threads)
            else:
                from tidal.engine_core.structured_output.backend_guidance import GuidanceBackend

                made = GuidanceBackend(self.model, self._hf)
            self._backends[name] = made
            self._only = made if len(self._backends) == 1 else None
            return made

    def hf_tokenizer(self) -> Any:
        """The shared HF tokenizer, for the reasoning markers too (reasoning_gate.py): loaded
        once, under the lock, as two threads importing transformers at once can find it
        half-initialized."""
        with self._lock:
            if self._hf is None:
                from tidal.engine_core.structured_output.backend_guidance import (
                    load_hf_tokenizer,
                )

                self._hf = load_hf_tokenizer(self.model)
            return self._hf

    def compile(self, params: StructuredOutputsParams) -> Matcher:
        name, why = spec.choose_backend(params, self.configured)
        logger.debug("structured output %s -> %s (%s)", params.kind, name, why)
        try:
            matcher = self.backend(name).compile(params)
        except ValueError as exc:
            fallback = (name == "xgrammar" and self.configured == "auto"
                        and params.backend is None)
            if not fallback:
                raise
            logger.debug("structured output %s -> guidance (xgrammar: %s)", params.kind, exc)
            name = "guidance"
            matcher = self.backend(name).compile(params)
        self.compiled_by[name] += 1
        return matcher

    def advance(self, steps: list[tuple[Any, int]]) -> list[bool]:
        """Each matcher consumes its token (by its own backend); whether each took it."""
        only = self._only
        if only is not None:
            return only.advance(steps)
        names = [getattr(m, "backend", "guidance") for m, _ in steps]
        first = names[0]
        if all(n == first for n in names):
            return self._backends[first].advance(steps)
        accepted = [False] * len(steps)
        for name in set(names):
            rows = [i for i, n in enumerate(names) if n == name]
            for i, ok in zip(rows, self._backends[name].advance([steps[i] for i in rows])):
                accepted[i] = ok
        return accepted

    def fill(self, matchers: list[Any], out: np.ndarray) -> None:
        """Row i of ``out`` = matchers[i]'s mask; each backend fills its own rows."""
        only = self._only
        if only is not None:
            only.fill(matchers, out)
            return
        # llguidance's matchers are its own objects; the others name their backend.
        names = [getattr(m, "backend", "guidance") for m in matchers]
        first = names[0]
        if all(n == first for n in names):
            self._backends[first].fill(matchers, out)
            return
        for name in set(names):
            rows = [i for i, n in enumerate(names) if n == name]
            part = np.empty((len(rows), out.shape[1]), dtype=np.int32)
            self._backends[name].fill([matchers[i] for i in rows], part)
            out[rows] = part
