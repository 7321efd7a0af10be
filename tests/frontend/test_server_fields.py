"""Request fields of OpenAI's and vLLM's APIs: each works or is a 400 naming it.

End to end against a tiny random-weight Llama (with a small word-level tokenizer and chat
template) served in this process over one engine process, each test with its own server
settings: ``prompt_logprobs`` and ``allowed_token_ids`` against HF transformers,
``return_tokens_as_token_ids``, ``stream_options.continuous_usage_stats`` through the official
``openai`` client, ``prompt_tokens_details`` behind its flag, ``/tokenize``'s
``continue_final_message`` and ``return_token_strs``, and the classification of every request
field of vLLM's chat and completion APIs (implemented / rejected / harmless).
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
import torch
from aiohttp.test_utils import TestServer

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.sampling_params import SamplingParams
from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.server.app import build_app, create_state
from tidal.frontend.server.errors import APIError
from tidal.frontend.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
)
from tidal.frontend.server.sampling import ServerLimits, chat_params, completion_params
from tidal.frontend.server.state import ServerSettings
from tidal.frontend.server.unsupported import GENERATION, HARMLESS

MODEL = "tiny"
# A prompt whose HF logits we compare against (token ids of the word-level vocabulary).
IDS = [12, 40, 7, 300, 21, 21, 99, 150, 3, 77, 260, 18, 45, 45, 45, 201, 9, 120]
CHAT = [{"role": "system", "content": "w3 w4 w5"}, {"role": "user", "content": "w10 w11 w12"}]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")


def _word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over ``vocab_size`` words: specials, chat roles, then w0, w1..."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "system", "user", "assistant", "developer", "tool", ":"]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def tiny(tiny_models, tmp_path_factory):
    """(engine, HF model, tokenizer): the tiny Llama with a tokenizer, behind one engine."""
    src, hf = tiny_models["llama"]
    folder = tmp_path_factory.mktemp("tiny-llama-served")
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    tok = _word_tokenizer(hf.config.vocab_size)
    tok.save_pretrained(folder)
    engine = AsyncLLM.from_engine_args(EngineArgs(
        model=str(folder), served_model_name=MODEL, num_kv_blocks=256, max_num_seqs=16,
        max_model_len=256, cpu_threads=1, dtype="float32"))
    yield engine, hf, tok
    engine.shutdown()


@asynccontextmanager
async def serve(engine: AsyncLLM, **settings: Any) -> AsyncIterator[TestServer]:
    state = create_state(engine, ServerSettings(**settings))
    async with TestServer(build_app(state), handler_cancellation=True) as server:
        yield server


def client(server: TestServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused",
                              max_retries=0, timeout=60)


async def post(server: TestServer, path: str, body: dict[str, Any]) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(server.make_url(path), json=body) as resp:
            return resp.status, await resp.json()


def run(coro):
    return asyncio.run(coro)


@torch.no_grad()
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """Row p: log-probabilities of the token after position p."""
    return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_prompt_logprobs(shown: list[dict[str, dict] | None], ids: list[int],
                          ref: torch.Tensor, k: int) -> None:
    """vLLM's shape: null first, then {token id: {logprob, rank, decoded_token}} holding the
    prompt token and the top-k, all as HF computes them."""
    assert len(shown) == len(ids) and shown[0] is None
    for p in range(1, len(ids)):
        row, tok, entry = ref[p - 1], ids[p], shown[p]
        assert entry is not None
        got = {int(t): v for t, v in entry.items()}
        assert math.isclose(got[tok]["logprob"], float(row[tok]), abs_tol=1e-3)
        # The value at the reported rank is the token's own (ties may order either way).
        ranked = row.sort(descending=True).values
        assert math.isclose(float(ranked[got[tok]["rank"] - 1]), float(row[tok]), abs_tol=1e-3)
        top_v, top_i = row.topk(k + 1)
        want = set(top_i[:k].tolist())
        if k and float(top_v[k - 1] - top_v[k]) > 1e-3:  # no near-tie at the cut
            assert set(got) - {tok} == want - {tok}
        assert len(got) <= k + 1
        for t, v in got.items():
            assert math.isclose(v["logprob"], float(row[t]), abs_tol=1e-3)
            assert v["decoded_token"] is not None
            if t != tok:
                assert 1 <= v["rank"] <= k


# --- prompt_logprobs -----------------------------------------------------------------------------


@pytest.mark.slow
def test_prompt_logprobs_completions_match_hf(tiny):
    engine, hf, tok = tiny
    other = IDS[::-1][:11]

    async def go():
        async with serve(engine) as server:
            async with client(server) as c:
                asked = await c.completions.create(
                    model=MODEL, prompt=[IDS, other], max_tokens=2, temperature=0,
                    echo=True, logprobs=1, extra_body={"prompt_logprobs": 3})
                plain = await c.completions.create(model=MODEL, prompt=IDS, max_tokens=2,
                                                   temperature=0)
            return asked, plain

    asked, plain = run(go())
    for choice, ids in zip(asked.choices, (IDS, other)):
        check_prompt_logprobs(choice.model_extra["prompt_logprobs"], ids, hf_logprobs(hf, ids), 3)
        # The echoed prompt keeps its own top-N (logprobs=1) from the same engine output.
        echoed = choice.logprobs.top_logprobs[1:len(ids)]
        assert all(1 <= len(top) <= 2 for top in echoed)
        assert choice.logprobs.tokens[0].strip() == tok.convert_ids_to_tokens(ids[0])
    assert plain.choices[0].model_extra["prompt_logprobs"] is None


@pytest.mark.slow
def test_prompt_logprobs_chat_match_hf_and_bounds(tiny):
    engine, hf, tok = tiny
    ids = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def go():
        async with serve(engine) as server:
            async with client(server) as c:
                resp = await c.chat.completions.create(
                    model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                    extra_body={"prompt_logprobs": 0})
                plain = await c.chat.completions.create(model=MODEL, messages=CHAT,
                                                        max_tokens=1)
            bad = []
            for path, body in (
                    ("/v1/completions", {"prompt": "w1", "prompt_logprobs": -1}),
                    ("/v1/completions", {"prompt": "w1", "prompt_logprobs": 21}),
                    ("/v1/completions", {"prompt": "w1", "prompt_logprobs": 1, "stream": True}),
                    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 99})):
                bad.append(await post(server, path, body))
            return resp, plain, bad

    resp, plain, bad = run(go())
    check_prompt_logprobs(resp.model_extra["prompt_logprobs"], ids, hf_logprobs(hf, ids), 0)
    assert resp.usage.prompt_tokens == len(ids)
    assert plain.model_extra["prompt_logprobs"] is None
    for status, body in bad:
        assert status == 400 and body["error"]["param"] == "prompt_logprobs", body


# --- allowed_token_ids ---------------------------------------------------------------------------


@torch.no_grad()
def hf_restricted_greedy(hf, prompt: list[int], allowed: list[int], n: int) -> list[int]:
    ids = list(prompt)
    mask = torch.full((hf.config.vocab_size,), float("-inf"))
    mask[allowed] = 0.0
    for _ in range(n):
        ids.append(int((hf(torch.tensor([ids])).logits[0, -1].float() + mask).argmax()))
    return ids[len(prompt):]


def _ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.mark.slow
def test_allowed_token_ids_restrict_sampling(tiny):
    engine, hf, _ = tiny
    allowed = [2, 17, 33, 64, 65, 200, 383]  # EOS among them: ignore_eos keeps going

    async def go():
        async with serve(engine) as server:
            async with client(server) as c:
                common = dict(model=MODEL, prompt=IDS, max_tokens=10, logprobs=0,
                              extra_body={"allowed_token_ids": allowed, "ignore_eos": True,
                                          "return_tokens_as_token_ids": True})
                greedy = await c.completions.create(temperature=0, **common)
                sampled = await c.completions.create(temperature=1.5, n=4, seed=7, **common)
                chat = await c.chat.completions.create(
                    model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, logprobs=True,
                    top_logprobs=10, extra_body={"allowed_token_ids": allowed,
                                                "ignore_eos": True,
                                                "return_tokens_as_token_ids": True})
            bad = [await post(server, "/v1/completions", {"prompt": "w1",
                                                            "allowed_token_ids": ids})
                   for ids in ([], [5, 384], [-1], list(range(8193)))]
            return greedy, sampled, chat, bad

    greedy, sampled, chat, bad = run(go())
    assert _ids(greedy.choices[0].logprobs.tokens) == hf_restricted_greedy(hf, IDS, allowed, 10)
    drawn = [t for choice in sampled.choices for t in _ids(choice.logprobs.tokens)]
    assert len(drawn) == 40 and set(drawn) <= set(allowed) and len(set(drawn)) > 1
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and set(_ids([e.token for e in content])) <= set(allowed)
    # The processed distribution: the allowed tokens hold all the probability; the top-10 are
    # them, then masked tokens at -9999 (OpenAI's stand-in for -inf).
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == 10 and set(_ids([t.token for t in top[:7]])) == set(allowed)
        assert math.isclose(sum(math.exp(t.logprob) for t in top[:7]), 1.0, abs_tol=1e-3)
        assert [t.logprob for t in top[7:]] == [-9999.0] * 3
    for status, body in bad:
        assert status == 400 and body["error"]["param"] == "allowed_token_ids", body


@pytest.mark.slow
def test_allowed_token_ids_through_async_llm(tiny):
    engine, hf, _ = tiny
    allowed = [40, 41, 42]

    async def go():
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                allowed_token_ids=allowed)
        return [out async for out in engine.generate(IDS, params, "allowed-direct")][-1]

    async def out_of_vocab():
        params = SamplingParams(max_tokens=2, allowed_token_ids=[1, 10**6])
        async for _ in engine.generate(IDS, params, "allowed-bad"):
            pass

    out = run(go())
    assert out.outputs[0].token_ids == hf_restricted_greedy(hf, IDS, allowed, 6)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        run(out_of_vocab())


# --- return_tokens_as_token_ids ------------------------------------------------------------------


@pytest.mark.slow
def test_return_tokens_as_token_ids(tiny):
    engine, _, tok = tiny

    async def go():
        async with serve(engine, return_tokens_as_token_ids=True) as server:
            async with client(server) as c:
                default = await c.completions.create(model=MODEL, prompt=IDS[:6], max_tokens=4,
                                                     temperature=0, logprobs=2, echo=True)
                text = await c.completions.create(
                    model=MODEL, prompt=IDS[:6], max_tokens=4, temperature=0, logprobs=2,
                    echo=True, extra_body={"return_tokens_as_token_ids": False})
                chat = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3,
                                                       temperature=0, logprobs=True,
                                                       top_logprobs=2)
            return default, text, chat

    default, text, chat = run(go())
    lp, ref = default.choices[0].logprobs, text.choices[0].logprobs
    assert _ids(lp.tokens) == tok.convert_tokens_to_ids(
        [t.strip() for t in ref.tokens])  # the same tokens, shown as ids
    assert lp.tokens[:6] == [f"token_id:{t}" for t in IDS[:6]]
    assert lp.token_logprobs == ref.token_logprobs
    # Offsets still count the text, so they index into the completion's text.
    assert lp.text_offset == ref.text_offset
    assert text.choices[0].text == default.choices[0].text
    for top, top_ref in zip(lp.top_logprobs[1:], ref.top_logprobs[1:]):
        assert sorted(top.values()) == sorted(top_ref.values())
        _ids(list(top))
    for entry in chat.choices[0].logprobs.content:
        (tid,) = _ids([entry.token])
        _ids([t.token for t in entry.top_logprobs])
        # bytes stay those of the token's text
        assert bytes(entry.bytes).decode().strip() == tok.convert_ids_to_tokens(tid)


# --- usage ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_continuous_usage_stats_on_every_chunk(tiny):
    engine, _, _ = tiny
    n_prompt = len(IDS)

    async def go():
        async with serve(engine) as server:
            async with client(server) as c:
                cmpl = await c.completions.create(
                    model=MODEL, prompt=IDS, max_tokens=6, temperature=0, stream=True,
                    extra_body={"ignore_eos": True},
                    stream_options={"include_usage": True, "continuous_usage_stats": True})
                cmpl_chunks = [ch async for ch in cmpl]
                chat = await c.chat.completions.create(
                    model=MODEL, messages=CHAT, max_tokens=5, temperature=0, stream=True, n=2,
                    extra_body={"ignore_eos": True},
                    stream_options={"continuous_usage_stats": True})
                chat_chunks = [ch async for ch in chat]
                only_final = await c.completions.create(
                    model=MODEL, prompt=IDS, max_tokens=3, temperature=0, stream=True,
                    stream_options={"include_usage": True})
                final_chunks = [ch async for ch in only_final]
            refused = await post(server, "/v1/completions", {
                "prompt": "w1", "stream_options": {"include_usage": True}})
            return cmpl_chunks, chat_chunks, final_chunks, refused

    cmpl_chunks, chat_chunks, final_chunks, refused = run(go())
    assert all(ch.usage is not None for ch in cmpl_chunks)
    counts = [ch.usage.completion_tokens for ch in cmpl_chunks if ch.choices]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] >= 1
    assert all(ch.usage.prompt_tokens == n_prompt for ch in cmpl_chunks)
    assert not cmpl_chunks[-1].choices and cmpl_chunks[-1].usage.total_tokens == n_prompt + 6
    assert cmpl_chunks[-1].usage.prompt_tokens_details is None  # no flag, no details

    assert all(ch.usage is not None for ch in chat_chunks)
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    for ch in chat_chunks[:-1]:
        (item,) = ch.choices
        per_choice[item.index].append(ch.usage.completion_tokens)
        assert ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens
    for seen in per_choice.values():
        assert seen[0] == 0 and seen == sorted(seen) and seen[-1] == 5  # the role chunk first
    # include_usage unset follows continuous_usage_stats: the whole request's usage at the end.
    assert not chat_chunks[-1].choices and chat_chunks[-1].usage.completion_tokens == 10

    assert [ch.usage is not None for ch in final_chunks] == \
        [False] * (len(final_chunks) - 1) + [True]
    status, body = refused
    assert status == 400 and body["error"]["param"] == "stream_options"


@pytest.mark.slow
def test_prompt_tokens_details_only_with_the_flag(tiny):
    engine, _, _ = tiny
    prompt = [(7 * i) % 300 + 9 for i in range(40)]  # 2 whole blocks of 16 to cache

    async def cached(server, stream: bool) -> list[Any]:
        async with client(server) as c:
            out = []
            for _ in range(2):
                if stream:
                    resp = await c.chat.completions.create(
                        model=MODEL, max_tokens=2, temperature=0, stream=True,
                        messages=[{"role": "user", "content": " ".join(
                            f"w{t}" for t in prompt)}],
                        stream_options={"include_usage": True})
                    out.append([ch.usage async for ch in resp if ch.usage][-1])
                else:
                    resp = await c.completions.create(model=MODEL, prompt=prompt,
                                                      max_tokens=2, temperature=0)
                    out.append(resp.usage)
            return out

    async def go():
        async with serve(engine) as server:
            off = await cached(server, False)
            raw = await post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        async with serve(engine, enable_prompt_tokens_details=True) as server:
            on = await cached(server, False) + await cached(server, True)
        return off, raw, on

    off, raw, on = run(go())
    assert all(u.prompt_tokens_details is None for u in off)
    assert raw[0] == 200 and "prompt_tokens_details" not in raw[1]["usage"]
    assert all(u.prompt_tokens_details is not None for u in on)
    assert on[1].prompt_tokens_details.cached_tokens == 32
    assert on[3].prompt_tokens_details.cached_tokens >= 32


# --- /tokenize -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_tokenize_continue_final_message_and_token_strs(tiny):
    engine, _, tok = tiny
    msgs = [*CHAT, {"role": "assistant", "content": "w20 w21"}]

    def ref(**kw: Any) -> list[int]:
        ids = tok.apply_chat_template(msgs, tokenize=True, **kw)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def go():
        async with serve(engine) as server:
            cont = await post(server, "/tokenize", {"messages": msgs,
                                                    "add_generation_prompt": False,
                                                    "continue_final_message": True,
                                                    "return_token_strs": True})
            closed = await post(server, "/tokenize", {"messages": msgs,
                                                      "add_generation_prompt": False})
            both = await post(server, "/tokenize", {"messages": msgs,
                                                    "continue_final_message": True})
            text = await post(server, "/tokenize", {"prompt": "w5 w6 w7",
                                                    "return_token_strs": True})
            chat = await post(server, "/v1/chat/completions", {
                "messages": msgs, "add_generation_prompt": False, "max_tokens": 1,
                "continue_final_message": True, "temperature": 0})
            chat_both = await post(server, "/v1/chat/completions", {
                "messages": msgs, "continue_final_message": True})
            return cont, closed, both, text, chat, chat_both

    cont, closed, both, text, chat, chat_both = run(go())
    status, body = cont
    assert status == 200
    assert body["tokens"] == ref(add_generation_prompt=False, continue_final_message=True)
    assert body["tokens"] != closed[1]["tokens"]  # the last message stays open
    assert closed[1]["tokens"] == ref(add_generation_prompt=False)
    assert closed[1]["token_strs"] is None
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    assert body["token_strs"][-2:] == ["w20", "w21"]
    assert text[1]["token_strs"] == ["w5", "w6", "w7"]
    assert chat[0] == 200 and chat[1]["usage"]["prompt_tokens"] == len(body["tokens"])
    for status, err in (both, chat_both):
        assert status == 400 and err["error"]["param"] == "continue_final_message"


# --- the field classification --------------------------------------------------------------------

# Every request field of vLLM's ChatCompletionRequest and CompletionRequest (recent versions and
# the guided_* fields of older ones), and OpenAI's extra chat fields.
VLLM_CHAT = """messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens
max_completion_tokens n presence_penalty response_format seed stop stream stream_options
temperature top_p tools tool_choice reasoning_effort thinking_token_budget include_reasoning
parallel_tool_calls user best_of use_beam_search top_k min_p repetition_penalty watermarking
length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens
skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side
prompt_logprobs logprob_token_ids allowed_token_ids bad_words echo add_generation_prompt
continue_final_message add_special_tokens documents chat_template chat_template_kwargs
media_io_kwargs mm_processor_kwargs structured_outputs guided_json guided_regex guided_choice
guided_grammar structural_tag guided_decoding_backend guided_whitespace_pattern priority
request_id session_id logits_processors return_tokens_as_token_ids return_token_ids
routed_experts_prompt_start return_token_offsets return_prompt_text return_mm_kwargs
cache_salt kv_transfer_params ec_transfer_params vllm_xargs repetition_detection
stream_interval functions function_call audio modalities prediction web_search_options
verbosity metadata store service_tier prompt_cache_key safety_identifier""".split()
VLLM_COMPLETION = """model prompt echo frequency_penalty logit_bias logprobs max_tokens n
presence_penalty seed stop stream stream_options suffix temperature top_p user use_beam_search
top_k min_p repetition_penalty watermarking length_penalty stop_token_ids
include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens truncation_side allowed_token_ids
prompt_logprobs logprob_token_ids bad_words prompt_embeds add_special_tokens response_format
structured_outputs guided_json guided_regex guided_choice guided_grammar
guided_decoding_backend guided_whitespace_pattern priority request_id session_id
logits_processors return_tokens_as_token_ids return_token_ids routed_experts_prompt_start
return_token_offsets return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params
vllm_xargs repetition_detection thinking_token_budget stream_interval best_of""".split()
# Beam search and best_of are another part's fields.
ELSEWHERE = {"use_beam_search", "best_of", "length_penalty", "early_stopping"}
# Declared fields that are rejected when set (completion_params refuses them).
REJECTED_WHEN_NOT_DEFAULT = {"suffix"}
# A value that asks for something, per rejected field (default: a string).
ASKS = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
        "functions": [{"name": "f"}], "function_call": "auto",
        "response_format": {"type": "json_object"}, "guided_choice": ["a", "b"],
        "structured_outputs": {"regex": "a+"}, "logits_processors": ["m.P"],
        "bad_words": ["w1"], "logprob_token_ids": [3], "truncate_prompt_tokens": 4,
        "prompt_embeds": "AAAA", "chat_template_kwargs": {"x": 1}, "documents": [{"t": "x"}],
        "add_special_tokens": True, "mm_processor_kwargs": {"x": 1},
        "media_io_kwargs": {"image": {}}, "modalities": ["text", "audio"],
        "audio": {"voice": "x"}, "prediction": {"type": "content", "content": "x"},
        "web_search_options": {}, "thinking_token_budget": 10, "priority": 1,
        "kv_transfer_params": {"x": 1}, "ec_transfer_params": {"x": 1},
        "vllm_xargs": {"x": 1}, "return_token_ids": True, "return_prompt_text": True,
        "watermarking": True, "repetition_detection": {"max_pattern_size": 4}}


def _classify(cls: type, name: str) -> str:
    if name in ELSEWHERE:
        return "elsewhere"
    if name in {f.encode_name for f in msgspec.structs.fields(cls)}:
        return "implemented"
    if name in GENERATION:
        return "rejected"
    assert name in HARMLESS, f"{cls.__name__}.{name} is not classified"
    return "harmless"


def _decode(cls: type, body: dict[str, Any]) -> Any:
    req = decode_request(json.dumps(body).encode(), cls)
    params = chat_params if cls is ChatCompletionRequest else completion_params
    return params(req, ServerLimits())


@pytest.mark.parametrize("cls,fields,base", [
    (ChatCompletionRequest, VLLM_CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
    (CompletionRequest, VLLM_COMPLETION, {"prompt": "hi"}),
], ids=["chat", "completion"])
def test_every_vllm_field_is_implemented_rejected_or_harmless(cls, fields, base):
    kinds: dict[str, list[str]] = {}
    for name in fields:
        kind = _classify(cls, name)
        kinds.setdefault(kind, []).append(name)
        if kind == "rejected" or name in REJECTED_WHEN_NOT_DEFAULT:
            with pytest.raises(APIError) as err:
                _decode(cls, {**base, name: ASKS.get(name, "x")})
            assert err.value.status == 400 and err.value.param == name
            assert "not supported" in err.value.message
        elif kind == "harmless":
            _decode(cls, {**base, name: "x"})
    # The no-op values of rejected fields are accepted.
    _decode(cls, {**base, "tools": None, "tool_choice": "none", "priority": 0,
                  "response_format": {"type": "text"}, "bad_words": [], "guided_json": None})
    for name in ("prompt_logprobs", "allowed_token_ids", "return_tokens_as_token_ids",
                 "stream_options", "logits_processors"):  # logits processors: plugins by name
        assert name in kinds["implemented"]
    assert {"guided_decoding_backend", "guided_whitespace_pattern",
            "structural_tag"} & set(fields) <= set(kinds["rejected"])
    # Tool calling is chat's (tests/frontend/test_server_tools.py); completions reject it.
    tool_kind = "implemented" if cls is ChatCompletionRequest else "rejected"
    assert {"tools", "tool_choice"} & set(fields) <= set(kinds[tool_kind])
    # Structured outputs (tests/frontend/test_server_structured.py).
    assert {"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
            "structured_outputs"} <= set(kinds["implemented"])


@pytest.mark.slow
def test_messages_roles_and_tool_fields(tiny):
    engine, _, _ = tiny
    cases = [
        ([{"role": "robot", "content": "w1"}], "messages[0].role"),
        ([{"role": "user", "content": "w1"}, {"role": "assistant", "content": None,
                                             "tool_calls": [{"id": "1", "type": "function"}]}],
         "messages[1].tool_calls[0].function"),
        ([{"role": "user", "content": "w1"}], "tools"),
    ]

    async def go():
        async with serve(engine) as server:
            out = []
            for messages, param in cases:
                body: dict[str, Any] = {"messages": messages, "max_tokens": 1}
                if param == "tools":
                    body["tools"] = [{"type": "function", "function": {"name": "f"}}]
                out.append((param, await post(server, "/v1/chat/completions", body)))
            ok = await post(server, "/v1/chat/completions", {
                "messages": [{"role": "developer", "content": "w1"},
                             {"role": "user", "content": "w2"}],
                "max_tokens": 1, "tool_choice": "none", "response_format": {"type": "text"}})
            return out, ok

    out, ok = run(go())
    for param, (status, body) in out:
        assert status == 400 and body["error"]["param"] == param, body
        assert body["error"]["code"] == "unsupported_field" or param.startswith("messages")
    assert ok[0] == 200, ok


def test_serve_flags_reach_the_settings():
    from tidal.frontend.cli import _server_settings, build_parser

    def settings(*flags: str) -> ServerSettings:
        return _server_settings(build_parser().parse_args(["serve", *flags]))

    on = settings("--return-tokens-as-token-ids", "--enable-prompt-tokens-details")
    assert on.return_tokens_as_token_ids and on.enable_prompt_tokens_details
    off = settings()
    assert not off.return_tokens_as_token_ids and not off.enable_prompt_tokens_details
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--return-tokens-as-token-ids" in help_text
    assert "--enable-prompt-tokens-details" in help_text
