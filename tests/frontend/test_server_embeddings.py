"""``POST /v1/embeddings`` on a real server hosting all-MiniLM-L6-v2: vectors equal the HF
reference (``AutoModel`` + mean pooling + L2 normalisation) within 1e-5, through the official
``openai`` client (base64, its default) and as plain floats."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from server_harness import API_KEY, embedding_server, minilm_path

pytestmark = pytest.mark.slow

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello", "Embeddings map text to "
         "vectors; similar meanings land close together. " * 4]
# The packaged model lives in a folder named `model`; it is served under its own name (its
# model card's title).
MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def server():
    return embedding_server()


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    return torch.nn.functional.normalize(pooled, dim=-1), ids


def test_embeddings_match_reference(server, reference):
    ref, ids = reference
    name = MODEL

    async def go():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY,
                                      max_retries=0) as c:
            b64 = await c.embeddings.create(model=name, input=TEXTS)
            floats = await c.embeddings.create(model=name, input=TEXTS, encoding_format="float")
            from_ids = await c.embeddings.create(model=name, input=ids[1])
            return b64, floats, from_ids

    b64, floats, from_ids = run(go())
    for resp in (b64, floats):
        assert [d.index for d in resp.data] == [0, 1, 2]
        got = torch.tensor([d.embedding for d in resp.data])
        assert got.shape == (3, 384)
        assert (got - ref).abs().max().item() < 1e-5
    assert b64.usage.prompt_tokens == sum(len(i) for i in ids)
    assert (torch.tensor(from_ids.data[0].embedding) - ref[1]).abs().max().item() < 1e-5


def test_served_under_the_models_own_name(server):
    async def go():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY,
                                      max_retries=0) as c:
            listed = [m.id async for m in c.models.list()]
            with pytest.raises(openai.NotFoundError):
                await c.embeddings.create(model="model", input="hi")  # the folder's name
            return listed

    assert run(go()) == [MODEL]


def test_embedding_server_rejects_generation(server):
    req = urllib.request.Request(server.url + "/v1/completions",
                                 data=json.dumps({"prompt": "hi"}).encode(),
                                 headers={"Authorization": f"Bearer {API_KEY}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    assert json.loads(err.value.read())["error"]["param"] == "model"


def test_embedding_input_too_long(server):
    async def go():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY,
                                      max_retries=0) as c:
            with pytest.raises(openai.BadRequestError) as err:
                await c.embeddings.create(model=MODEL, input="word " * 600)
            return err.value

    err = run(go())
    assert err.body["param"] == "input" and "at most 512" in err.body["message"]


def test_embedding_input_of_exactly_the_context_length(server):
    """An encoder needs no free position to generate into: max_model_len tokens are fine."""
    async def go():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY,
                                      max_retries=0) as c:
            return await c.embeddings.create(model=MODEL, input=[101] + [2773] * 510 + [102])

    out = run(go())
    assert len(out.data) == 1 and len(out.data[0].embedding) == 384
    assert out.usage.prompt_tokens == 512


def test_embedding_truncate_prompt_tokens(server):
    """``truncate_prompt_tokens`` cuts an input to its last (or first) k tokens: the same
    embedding as those tokens sent as they are; -1 fits an input too long otherwise."""
    ids = [[101, 2023, 2003, 1037, 2146, 6251, 2055, 2686, 102]] * 2

    async def go():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY,
                                      max_retries=0) as c:
            cut = await c.embeddings.create(model=MODEL, input=ids[1],
                                            extra_body={"truncate_prompt_tokens": 4})
            last = await c.embeddings.create(model=MODEL, input=ids[1][-4:])
            cut_right = await c.embeddings.create(model=MODEL, input=ids[1], extra_body={
                "truncate_prompt_tokens": 4, "truncation_side": "right"})
            first = await c.embeddings.create(model=MODEL, input=ids[1][:4])
            long = await c.embeddings.create(model=MODEL, input="word " * 600,
                                             extra_body={"truncate_prompt_tokens": -1})
            return cut, last, cut_right, first, long

    cut, last, cut_right, first, long = run(go())
    assert cut.usage.prompt_tokens == 4 and cut_right.usage.prompt_tokens == 4
    assert cut.data[0].embedding == last.data[0].embedding
    assert cut_right.data[0].embedding == first.data[0].embedding
    assert cut.data[0].embedding != cut_right.data[0].embedding
    assert long.usage.prompt_tokens == 512


def test_embedding_fields_that_would_change_the_vectors(server):
    """``add_special_tokens: false`` leaves out [CLS] / [SEP] (two tokens fewer, another
    vector); vLLM's fields this server cannot honour are 400s naming them, their no-op values
    accepted."""
    async def go():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY,
                                      max_retries=0) as c:
            plain = await c.embeddings.create(model=MODEL, input="a short sentence")
            bare = await c.embeddings.create(model=MODEL, input="a short sentence",
                                             extra_body={"add_special_tokens": False})
            noop = await c.embeddings.create(model=MODEL, input="a short sentence", extra_body={
                "normalize": True, "embed_dtype": "float32", "priority": 0})
            refused = []
            for extra in ({"normalize": False}, {"embed_dtype": "float16"},
                          {"priority": 5}, {"endianness": "big"}):
                with pytest.raises(openai.BadRequestError) as err:
                    await c.embeddings.create(model=MODEL, input="x", extra_body=extra)
                refused.append(err.value.body["param"])
            return plain, bare, noop, refused

    plain, bare, noop, refused = run(go())
    assert bare.usage.prompt_tokens == plain.usage.prompt_tokens - 2
    assert bare.data[0].embedding != plain.data[0].embedding
    assert noop.data[0].embedding == plain.data[0].embedding
    assert refused == ["normalize", "embed_dtype", "priority", "endianness"]


def run(coro):
    return asyncio.run(coro)
