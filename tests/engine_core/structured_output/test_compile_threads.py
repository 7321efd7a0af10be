"""The grammar compile pool's size (``envs.grammar_compile_threads``, the manager's pool): a
burst of distinct schemas queues on it, so it follows the CPUs."""

from __future__ import annotations

import os

from tidal.engine_core import envs
from tidal.engine_core.config import EngineArgs
from tidal.engine_core.structured_output.manager import StructuredOutputManager


def test_compile_threads_follow_the_cpus_or_the_setting(monkeypatch, tiny_qwen3):
    """Grammars compile on half the CPUs (2 to 8) unless $TIDAL_GRAMMAR_COMPILE_THREADS says;
    the manager's pool takes that size."""
    monkeypatch.delenv("TIDAL_GRAMMAR_COMPILE_THREADS", raising=False)
    for cpus, want in ((1, 2), (2, 2), (16, 8), (128, 8), (12, 6)):
        monkeypatch.setattr(os, "cpu_count", lambda cpus=cpus: cpus)
        assert envs.grammar_compile_threads() == want
    monkeypatch.setenv("TIDAL_GRAMMAR_COMPILE_THREADS", "3")
    assert envs.grammar_compile_threads() == 3
    model = EngineArgs(model=str(tiny_qwen3)).create_config().model
    mgr = StructuredOutputManager(model, "guidance")
    assert mgr._num_threads == 3
    assert StructuredOutputManager(model, "guidance", num_threads=5)._num_threads == 5
    mgr.shutdown()
