"""``POST /v1/embeddings``: one unit vector per input, from a pooling model (``--task embed``).

``encoding_format="base64"`` (what OpenAI's Python client asks for by default) sends each vector
as base64 of little-endian float32 bytes.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from aiohttp import web

from tidal.frontend.server.common import json_response, new_id, read_body
from tidal.frontend.server.errors import APIError, bad_request, from_exception
from tidal.frontend.server.openai_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    decode_request,
)
from tidal.frontend.server.prompts import split_prompts, tokenize_prompts, truncate_prompts
from tidal.frontend.server.state import get_state


async def create_embedding(request: web.Request) -> web.Response:
    state = get_state(request)
    req = decode_request(await read_body(request, state), EmbeddingRequest)
    model = state.check_model(req.model)
    state.require_task("embed", "/v1/embeddings")
    if req.encoding_format not in ("float", "base64"):
        raise bad_request(f"encoding_format must be 'float' or 'base64', got "
                          f"{req.encoding_format[:40]!r}", "encoding_format")
    dim = state.engine.config.model.arch.hidden_size
    if req.dimensions is not None and req.dimensions != dim:
        raise bad_request(f"this model's embeddings have {dim} dimensions and cannot be "
                          f"shortened; omit dimensions or pass {dim}", "dimensions")
    raw = split_prompts(req.input, "input", state.limits.max_prompts)
    state.admission.check_available()
    prompts = truncate_prompts(
        await tokenize_prompts(state, raw, "input", req.add_special_tokens), req,
        state.max_model_len)
    for p in prompts:
        if len(p.token_ids) > state.max_model_len:
            raise bad_request(f"an input has {len(p.token_ids)} tokens but this model takes at "
                              f"most {state.max_model_len}; shorten it", "input",
                              code="context_length_exceeded")

    request_id = new_id("embd")
    ticket = state.admission.admit(len(prompts))
    tasks = [asyncio.create_task(state.engine.encode(p.token_ids, f"{request_id}-{i}"))
             for i, p in enumerate(prompts)]
    try:
        outs = await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to the client's error envelope
        raise from_exception(exc, request_id) from None
    finally:
        for t in tasks:
            t.cancel()  # no-op for finished ones; a cancelled encode aborts in the engine
        await asyncio.gather(*tasks, return_exceptions=True)
        state.release(ticket)
    data = []
    for i, out in enumerate(outs):
        if not out.embedding:
            raise APIError(500, "the engine returned no embedding for an input",
                           code="request_failed")
        vector: list[float] | str = out.embedding
        if req.encoding_format == "base64":
            vector = base64.b64encode(np.asarray(out.embedding, dtype="<f4").tobytes()).decode()
        data.append(EmbeddingData(index=i, embedding=vector))
    n_tokens = sum(len(p.token_ids) for p in prompts)
    return json_response(EmbeddingResponse(data=data, model=model,
                                            usage=EmbeddingUsage(n_tokens, n_tokens)))
