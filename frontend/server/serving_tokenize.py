"""``POST /tokenize`` (a prompt, or chat messages through the template) and
``POST /detokenize``, with the served model's tokenizer."""

from __future__ import annotations

import asyncio

from aiohttp import web

from tidal.frontend.server.common import json_response, read_body
from tidal.frontend.server.errors import bad_request
from tidal.frontend.server.openai_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    decode_request,
)
from tidal.frontend.server.prompts import tokenize_text
from tidal.frontend.server.serving_chat import (
    check_generation_prompt,
    messages_to_dicts,
    render_chat,
)
from tidal.frontend.server.state import get_state


async def tokenize(request: web.Request) -> web.Response:
    state = get_state(request)
    req = decode_request(await read_body(request, state), TokenizeRequest)
    await state.resolve_model(req.model)  # an adapter shares the base model's tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if req.prompt is not None:
        if req.continue_final_message:
            raise bad_request("continue_final_message applies to messages, not to a prompt",
                              "continue_final_message")
        ids = await tokenize_text(state, req.prompt, req.add_special_tokens)
    else:
        check_generation_prompt(req.add_generation_prompt, req.continue_final_message)
        ids = await render_chat(state, messages_to_dicts(req.messages), req.add_generation_prompt,
                                state.settings.chat_template, req.continue_final_message)
    # The tokenizer's own pieces (e.g. "Ġhello"), as vLLM's return_token_strs gives them.
    strs = list(state.tokenizer.convert_ids_to_tokens(ids)) if req.return_token_strs else None
    return json_response(TokenizeResponse(count=len(ids), max_model_len=state.max_model_len,
                                          tokens=ids, token_strs=strs))


async def detokenize(request: web.Request) -> web.Response:
    state = get_state(request)
    req = decode_request(await read_body(request, state), DetokenizeRequest)
    await state.resolve_model(req.model)  # an adapter shares the base model's tokenizer
    vocab = state.engine.config.model.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    tok = state.tokenizer
    if len(req.tokens) <= 4096:
        text = tok.decode(req.tokens)
    else:
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(None, tok.decode, req.tokens)
    return json_response(DetokenizeResponse(prompt=text))
