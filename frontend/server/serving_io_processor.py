"""``POST /v1/io_processor/{name}``: a custom request body, turned into prompts by the IO
processor plugin ``name`` (``tidal.io_processor_plugins``), run through the engine, and the
outputs turned back into the plugin's response (``server_plugins.py`` has the interface).

The body is any JSON value (within the body limit and depth); the plugin raises ValueError for
one it cannot take (a 400 with its message). Prompts are checked as every endpoint checks them
(count, vocabulary, context length), and run to completion before the response is made.
"""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from tidal.engine_core.sampling_params import OutputKind, SamplingParams
from tidal.frontend.outputs import RequestOutput
from tidal.frontend.server.common import check_prompt, json_response, new_id, read_body
from tidal.frontend.server.errors import APIError, bad_request, from_exception
from tidal.frontend.server.generation import Generation
from tidal.frontend.server.json_depth import check_json_depth
from tidal.frontend.server.prompts import check_context, tokenize_prompts
from tidal.frontend.server.server_plugins import IOProcessorInput
from tidal.frontend.server.state import get_state


async def io_processor(request: web.Request) -> web.Response:
    state = get_state(request)
    name = request.match_info["name"]
    proc = state.plugins.io_processors.get(name)
    if proc is None:
        shown = name if len(name) <= 100 else name[:100] + "..."
        raise APIError(404, f"no IO processor {shown!r} on this server; it has "
                       f"{', '.join(sorted(state.plugins.io_processors)) or 'none'} "
                       "(tidal.io_processor_plugins entry points)", code="not_found")
    raw = await read_body(request, state)
    check_json_depth(raw)
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise bad_request("the request body is not valid JSON", None) from None
    try:
        parsed = proc.parse_request(body)
    except (ValueError, TypeError, KeyError) as exc:
        raise bad_request(f"IO processor {name}: {str(exc)[:500]}", None) from None
    if not isinstance(parsed, IOProcessorInput) or not parsed.prompts:
        raise APIError(500, f"IO processor {name} returned no prompts", code="plugin_error")
    if len(parsed.prompts) > state.limits.max_prompts:
        raise bad_request(f"IO processor {name} made {len(parsed.prompts)} prompts; the limit "
                          f"is {state.limits.max_prompts} per request", None)
    state.admission.check_available()
    prompts = await tokenize_prompts(state, parsed.prompts, "prompt")
    request_id = new_id("io")
    if state.task == "embed":
        outputs = await _encode(state, [p.token_ids for p in prompts], request_id)
    else:
        if parsed.params.n != 1:
            raise APIError(500, f"IO processor {name} asked for n={parsed.params.n}; one "
                           "output per prompt is taken", code="plugin_error")
        params = msgspec.structs.replace(parsed.params, output_kind=OutputKind.FINAL_ONLY)
        for p in prompts:
            check_context(len(p.token_ids), params.max_tokens, state.max_model_len)
            check_prompt(state, p.token_ids, params, "prompt")
        outputs = await _generate(state, [p.token_ids for p in prompts], params, request_id)
    try:
        result = proc.output_to_response(body, outputs)
    except (ValueError, TypeError, KeyError) as exc:
        raise bad_request(f"IO processor {name}: {str(exc)[:500]}", None) from None
    return json_response(result)


async def _generate(state, prompts: list[list[int]], params: SamplingParams,
                    request_id: str) -> list[RequestOutput]:
    ticket = state.admission.admit(len(prompts))
    gen = Generation(state.engine, state.admission, ticket, request_id, prompts, params)
    final: dict[int, RequestOutput] = {}
    try:
        async for batch in gen.stream():
            for index, out in batch:
                final[index] = out
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to the client's envelope
        raise from_exception(exc, request_id) from None
    finally:
        gen.close()
        state.release(ticket)
    if gen.aborted or len(final) != len(prompts):
        raise APIError(503, "the request was aborted (the server is shutting down)",
                       code="aborted")
    return [final[i] for i in range(len(prompts))]


async def _encode(state, prompts: list[list[int]], request_id: str) -> list:
    for ids in prompts:
        if len(ids) > state.max_model_len:
            raise bad_request(f"a prompt has {len(ids)} tokens but this model takes at most "
                              f"{state.max_model_len}", "prompt", code="context_length_exceeded")
    ticket = state.admission.admit(len(prompts))
    tasks = [asyncio.create_task(state.engine.encode(ids, f"{request_id}-{i}"))
             for i, ids in enumerate(prompts)]
    try:
        return list(await asyncio.gather(*tasks))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise from_exception(exc, request_id) from None
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        state.release(ticket)
