"""LoRA through ``AsyncLLM``: the control calls (add / list / remove) reach the engine through
the threaded client and the multiprocess (ZMQ) one alike, a bad adapter raises
``LoRAAdapterError`` naming the problem with the engine unharmed, and ``generate`` with a
``lora_request`` gives the adapter's outputs (HF + PEFT's greedy tokens)."""

from __future__ import annotations

import asyncio

import pytest

from lora_adapters import make_peft_adapter, peft_reference
from reference import hf_greedy
from tidal.engine_core.config import EngineArgs
from tidal.engine_core.lora_adapter import LoRAAdapterError
from tidal.frontend import LoRARequest, SamplingParams
from tidal.frontend.async_llm import AsyncLLM, RequestFailedError

PROMPT = [5, 17, 33, 99, 7, 12]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter(tiny_models, tmp_path_factory):
    _, hf = tiny_models["llama"]
    path = make_peft_adapter(hf, tmp_path_factory.mktemp("lora") / "a", r=8,
                             targets=["q_proj", "v_proj", "gate_proj"], seed=3)
    return path, hf_greedy(peft_reference(hf, path), PROMPT, 6)[0]


async def _tokens(llm: AsyncLLM, rid: str, lora: LoRARequest | None) -> list[int]:
    out = None
    async for out in llm.generate(PROMPT, PARAMS, rid, lora_request=lora):
        pass
    assert out is not None
    return out.outputs[0].token_ids


def _exercise(llm: AsyncLLM, path, expected: list[int], tmp_path) -> None:
    good = LoRARequest("good", 1, str(path))

    async def main():
        assert await llm.list_loras() == []
        assert await llm.add_lora(good) is True
        assert await llm.add_lora(good) is False  # known already
        with pytest.raises(LoRAAdapterError, match="already adapter 'good'"):
            await llm.add_lora(LoRARequest("other", 1, str(tmp_path)))
        with pytest.raises(LoRAAdapterError, match="has no adapter_config.json"):
            await llm.add_lora(LoRARequest("empty", 2, str(tmp_path)))
        assert await llm.list_loras() == [1]
        assert await _tokens(llm, "r1", good) == expected
        # A request naming a bad adapter fails alone.
        with pytest.raises(RequestFailedError, match="is not a directory"):
            await _tokens(llm, "r2", LoRARequest("gone", 3, str(tmp_path / "gone")))
        assert await _tokens(llm, "r3", good) == expected
        assert await llm.remove_lora(1) is True
        assert await llm.remove_lora(1) is False
        assert await llm.list_loras() == []

    asyncio.run(main())


def test_thread_client(tiny_models, adapter, tmp_path):
    folder, _ = tiny_models["llama"]
    llm = AsyncLLM.from_engine_args(
        EngineArgs(model=str(folder), num_kv_blocks=64, dtype="float32", enable_lora=True),
        mode="thread", skip_tokenizer_init=True)
    try:
        _exercise(llm, *adapter, tmp_path)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_process_client(tiny_models, adapter, tmp_path):
    folder, _ = tiny_models["llama"]
    llm = AsyncLLM.from_engine_args(
        EngineArgs(model=str(folder), num_kv_blocks=64, dtype="float32", enable_lora=True,
                   cpu_threads=1),
        skip_tokenizer_init=True)
    try:
        _exercise(llm, *adapter, tmp_path)
    finally:
        llm.shutdown()


def test_refused_without_enable_lora(tiny_models, adapter):
    folder, _ = tiny_models["llama"]
    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(folder), num_kv_blocks=64),
                                    mode="thread", skip_tokenizer_init=True)
    lora = LoRARequest("good", 1, str(adapter[0]))

    async def main():
        with pytest.raises(LoRAAdapterError, match="--enable-lora"):
            await llm.add_lora(lora)
        with pytest.raises(ValueError, match="--enable-lora"):
            await _tokens(llm, "r", lora)

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
