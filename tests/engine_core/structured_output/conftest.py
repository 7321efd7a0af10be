"""Shared by the structured-output tests: a tiny random-weight Qwen3 with the real Qwen3
tokenizer, and a ``StructuredOutputManager`` over it on each backend."""

from __future__ import annotations

import pytest

import reference
from tidal.engine_core.config import EngineArgs
from tidal.engine_core.protocol import EngineCoreRequest
from tidal.engine_core.reasoning_formats import REASONING_FORMATS
from tidal.engine_core.request import Request
from tidal.engine_core.sampling_params import SamplingParams
from tidal.engine_core.structured_output.manager import StructuredOutputManager


@pytest.fixture(scope="session")
def tiny_qwen3(qwen3_tokenizer, tmp_path_factory):
    """Random weights, Qwen3's shapes in miniature, the real tokenizer and chat template
    (``<think>`` / ``</think>`` are single tokens)."""
    return reference.make_tiny_qwen3_with_tokenizer(
        qwen3_tokenizer, tmp_path_factory.mktemp("tiny-qwen3-think"))


@pytest.fixture(scope="module", params=["guidance", "xgrammar"])
def manager(tiny_qwen3, request):
    """A manager of the engine's kind (qwen3 reasoning markers), without an engine: tests
    submit requests and drive it by hand (``admit``)."""
    if request.param == "xgrammar":
        pytest.importorskip("xgrammar", reason="the optional xgrammar backend is not installed")
    model = EngineArgs(model=str(tiny_qwen3)).create_config().model
    mgr = StructuredOutputManager(model, request.param, reasoning=REASONING_FORMATS["qwen3"])
    yield mgr
    mgr.shutdown()


def _admit(mgr: StructuredOutputManager, rid: str, prompt: list[int], **params) -> None:
    mgr.submit(Request.from_engine_request(
        EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=64, **params)), 4096,
        frozenset()))
    for _ in range(2000):
        ready, failed = mgr.take_ready()
        assert not failed, failed
        if ready:
            return
        mgr.wait_for_compiles(0.01)
    raise AssertionError("no compile finished")


@pytest.fixture
def admit():
    """``admit(manager, rid, prompt, **sampling_params)``: submit a request and wait until
    its grammar compiled (it is then in ``manager.states``)."""
    return _admit
