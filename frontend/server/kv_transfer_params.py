"""``kv_transfer_params`` in the OpenAI API (vLLM's extension for disaggregated prefill/decode).

A request may carry an object ``kv_transfer_params`` (``{"do_remote_decode": true}`` for the
prefill instance; the prefill answer's ``kv_transfer_params`` for the decode instance), and a
whole (non-streamed) response returns the engine's answer as a top-level ``kv_transfer_params``
(``null`` when there is none), as vLLM does. Both only on a server started with a KV connector
that transfers between instances; elsewhere the field is a 400 naming it, never ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from tidal.engine_core.kv_transfer.p2p_connector import (
    KVTransferParamsError,
    check_producer_allowed,
    check_transfer_params,
)
from tidal.engine_core.kv_transfer_config import OFFLOADING_CONNECTOR
from tidal.frontend.server.errors import bad_request

if TYPE_CHECKING:
    from tidal.engine_core.config import EngineConfig
    from tidal.frontend.server.generation import Generation
    from tidal.frontend.server.state import ServerState

PARAM = "kv_transfer_params"
P2P_CONNECTOR = "P2pConnector"
# Bytes of the object as JSON: a producer's answer lists its request's block ids (a few per
# thousand prompt tokens); more than this is not an answer of ours.
MAX_PARAMS_BYTES = 1 << 20


def transfers_kv(config: EngineConfig) -> bool:
    """Whether this engine has a connector that moves KV between instances."""
    kv = config.kv_transfer
    return kv is not None and kv.kv_connector != OFFLOADING_CONNECTOR


def check_request_params(state: ServerState, params: dict[str, Any] | None, n: int,
                         num_prompts: int) -> dict[str, Any] | None:
    """The request's ``kv_transfer_params``, checked; a 400 naming the field when this server
    cannot act on them."""
    if params is None:
        return None
    kv = state.engine.config.kv_transfer
    if kv is None or not transfers_kv(state.engine.config):
        raise bad_request(
            "kv_transfer_params needs a server started for disaggregated prefill/decode "
            "(--kv-transfer-config '{\"kv_connector\": \"P2pConnector\", \"kv_role\": ...}')",
            PARAM)
    if n != 1 or num_prompts != 1:
        raise bad_request("kv_transfer_params takes one prompt and n=1 (its KV is one "
                          "request's)", PARAM)
    if len(msgspec.json.encode(params)) > MAX_PARAMS_BYTES:
        raise bad_request(f"kv_transfer_params is larger than {MAX_PARAMS_BYTES} bytes", PARAM)
    if kv.kv_connector == P2P_CONNECTOR:
        try:
            check_transfer_params(params)
            check_producer_allowed(params, list(kv.extra("allowed_producers", [])))
        except KVTransferParamsError as exc:
            raise bad_request(str(exc), PARAM) from None
        if params.get("do_remote_decode") and not kv.is_producer:
            raise bad_request("kv_transfer_params.do_remote_decode needs a prefill instance "
                              f"(kv_role kv_producer or kv_both); this one is {kv.kv_role}",
                              PARAM)
        if params.get("do_remote_prefill") and not kv.is_consumer:
            raise bad_request("kv_transfer_params.do_remote_prefill needs a decode instance "
                              f"(kv_role kv_consumer or kv_both); this one is {kv.kv_role}",
                              PARAM)
    return params


def with_answer(gen: Generation, body: msgspec.Struct) -> Any:
    """A whole response with its engine request's ``kv_transfer_params`` answer added at the
    top level (on a server that transfers KV; ``body`` unchanged elsewhere)."""
    if not transfers_kv(gen.engine.config):
        return body
    out = msgspec.to_builtins(body)
    out[PARAM] = gen.kv_transfer_answer
    return out
