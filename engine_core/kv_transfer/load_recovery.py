"""Dropping a step's outputs for requests whose KV load failed (the scheduler recomputes them).

A connector that loads synchronously (in ``start_load_kv``) learns that a transfer failed only in
the step that already runs the request on those blocks: the worker reports the blocks it could not
fill (``ModelRunnerOutput.kv_invalid_block_ids``), and every output of the requests holding them,
of that step and of any step launched before the scheduler heard of it, is garbage and goes.
"""

from __future__ import annotations

import msgspec
import numpy as np

from tidal.engine_core.protocol import LogprobsArrays, ModelRunnerOutput


def drop_outputs(result: ModelRunnerOutput, request_ids: set[str]) -> ModelRunnerOutput:
    """``result`` without anything of ``request_ids`` (sampled tokens with their logprobs rows
    and drafts, prompt logprobs, failures, embeddings)."""
    keep = [i for i, rid in enumerate(result.req_ids) if rid not in request_ids]
    logprobs = result.logprobs
    if logprobs is not None and len(keep) < len(result.req_ids):
        # One logprobs row per sampled token, in request order.
        counts = [len(t) for t in result.sampled_token_ids]
        starts = np.cumsum([0] + counts[:-1])
        rows = np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in keep]) \
            if keep else np.zeros(0, dtype=np.int64)
        logprobs = LogprobsArrays(logprobs.token_ids[rows], logprobs.logprobs[rows],
                                  logprobs.ranks[rows])
    return msgspec.structs.replace(
        result,
        req_ids=[result.req_ids[i] for i in keep],
        sampled_token_ids=[result.sampled_token_ids[i] for i in keep],
        logprobs=logprobs,
        spec_token_ids=[result.spec_token_ids[i] for i in keep] if result.spec_token_ids else [],
        prompt_logprobs={k: v for k, v in result.prompt_logprobs.items()
                         if k not in request_ids},
        failed={k: v for k, v in result.failed.items() if k not in request_ids},
        pooled={k: v for k, v in result.pooled.items() if k not in request_ids},
    )
