"""vLLM's prompt dicts in ``LLM.generate`` and ``AsyncLLM.generate``: ``{"prompt": text}``,
``{"prompt_token_ids": ids}``, each with an optional ``"cache_salt"``; unknown keys are an error
naming the key. Runs a tiny random-weight Qwen3 with the real Qwen3 tokenizer (digit strings
tokenize to ids inside the tiny vocabulary)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from tidal.engine_core.config import EngineArgs
from tidal.frontend import LLM, SamplingParams
from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.prompt_inputs import parse_prompts

TEXT = "31415926535897932384"  # 20 tokens, one per digit
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_models, qwen3_tokenizer, tmp_path_factory):
    folder, _ = tiny_models["qwen3"]
    out = tmp_path_factory.mktemp("tiny-qwen3-tokenizer")
    for f in folder.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    qwen3_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = LLM(str(model_dir), num_kv_blocks=128)
    yield llm
    llm.shutdown()


def _result(out):
    return out.prompt_token_ids, [(c.token_ids, c.text) for c in out.outputs]


def test_each_form_gives_the_plain_forms_output(llm):
    ids = llm.get_tokenizer().encode(TEXT)
    assert len(ids) == 20 and max(ids) < llm.config.model.vocab_size
    plain_text, plain_ids = llm.generate([TEXT, ids], PARAMS, use_tqdm=False)
    assert _result(plain_text) == _result(plain_ids)
    forms = [{"prompt": TEXT}, {"prompt_token_ids": ids}, {"prompt": TEXT, "cache_salt": "a"},
             {"prompt_token_ids": ids, "cache_salt": "a"}, TEXT, ids]
    outs = llm.generate(forms, PARAMS, use_tqdm=False)
    assert [_result(o) for o in outs] == [_result(plain_text)] * len(forms)
    assert [o.prompt for o in outs] == [TEXT, None, TEXT, None, TEXT, None]
    # One dict alone is one prompt; with both keys the ids run and the text is reported.
    (single,) = llm.generate({"prompt_token_ids": ids, "prompt": "pi"}, PARAMS, use_tqdm=False)
    assert _result(single) == _result(plain_ids) and single.prompt == "pi"


def test_cache_salt_separates_prefix_cache_hits(llm):
    prompt = [(i * 7) % 300 + 1 for i in range(40)]  # no other test sends it

    def cached(**salt) -> int:
        (out,) = llm.generate([{"prompt_token_ids": prompt, **salt}], PARAMS, use_tqdm=False)
        return out.num_cached_tokens

    # Whole 16-token blocks are shared, and only between requests with the same salt.
    assert [cached(cache_salt="a"), cached(cache_salt="a"), cached(cache_salt="b"), cached(),
            cached(), cached(cache_salt="b")] == [0, 32, 0, 0, 32, 32]


@pytest.mark.parametrize("prompt, match", [
    ({"prompt": "1", "multi_modal_data": {"image": None}}, "'multi_modal_data'"),
    ({"prompt_token_ids": [1], "mm_processor_kwargs": {}}, "'mm_processor_kwargs'"),
    ({"cache_salt": "a"}, "needs 'prompt'"),
    ({"prompt": 5}, "'prompt' must be a string"),
    ({"prompt_token_ids": ["1"]}, "integers only"),
    ({"prompt": "1", "cache_salt": 3}, "'cache_salt' must be a string"),
    (3.5, "got float"),
])
def test_bad_prompts_are_errors(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["1", prompt], PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match=match):
        parse_prompts(prompt if isinstance(prompt, dict) else [prompt])


def test_async_llm_takes_prompt_dicts(llm, model_dir):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(model_dir), num_kv_blocks=128),
                                       mode="thread")
    ids = llm.get_tokenizer().encode(TEXT)
    prompt = [(i * 11) % 300 + 1 for i in range(40)]

    async def one(p, rid, **kw):
        return [o async for o in engine.generate(p, PARAMS, rid, **kw)][-1]

    async def main():
        outs = [await one(p, f"r{i}") for i, p in enumerate(
            [TEXT, ids, {"prompt": TEXT}, {"prompt_token_ids": ids, "cache_salt": "x"}])]
        salted = [await one({"prompt_token_ids": prompt, "cache_salt": s}, f"s{i}")
                  for i, s in enumerate(["a", "a", "b"])]
        # The keyword and the dict may name the same salt, not two.
        same = await one({"prompt_token_ids": prompt, "cache_salt": "b"}, "k1", cache_salt="b")
        with pytest.raises(ValueError, match="cache_salt"):
            await one({"prompt_token_ids": prompt, "cache_salt": "a"}, "k2", cache_salt="b")
        with pytest.raises(ValueError, match="'multi_modal_data'"):
            await one({"prompt": TEXT, "multi_modal_data": {}}, "k3")
        return outs, salted, same

    try:
        outs, salted, same = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [_result(o) for o in outs] == [_result(outs[0])] * 4
    assert [o.prompt for o in outs] == [TEXT, None, TEXT, None]
    assert [o.num_cached_tokens for o in salted] == [0, 32, 0]
    assert same.num_cached_tokens == 32
