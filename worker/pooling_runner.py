"""Runs an embedding (pooling) model: same interface as ``ModelRunner``, no KV cache.

An encoder attends both ways, so a prompt is encoded whole in the step that completes it (the
config turns chunked prefill off for task "embed"; partial schedules are still handled by
waiting for the rest). The scheduler still accounts KV blocks for every running prompt, so the
runner reports a nominal pool large enough for ``max_num_seqs`` full-length prompts; nothing is
allocated for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.protocol import ModelRunnerOutput, SchedulerOutput
from tidal.worker.loader.model_loader import load_model

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Prompt:
    token_ids: list[int]
    num_scheduled: int  # tokens scheduled so far (the whole prompt is encoded at the end)


class PoolingRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []  # always empty: an encoder keeps no KV
        self._prompts: dict[str, _Prompt] = {}

    def load_model(self) -> None:
        # Encoders have no paged attention, so no attention backend is chosen.
        self.model = load_model(self.config.model, self.device, None)  # type: ignore[arg-type]

    def determine_num_blocks(self) -> int:
        if self.config.cache.num_blocks is not None:
            return self.config.cache.num_blocks
        return self.config.scheduler.max_num_seqs * self.config.max_blocks_per_seq

    def init_kv_cache(self, num_blocks: int) -> None:
        return None  # nothing to allocate: the blocks are bookkeeping only

    def release(self) -> None:
        """Drop the model at shutdown (``ModelRunner.release``)."""
        self.model = None

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self._prompts.pop(rid, None)
        for new in so.new_reqs:
            # A preempted request comes back as new: it starts over.
            self._prompts[new.req_id] = _Prompt(list(new.prompt_token_ids), 0)
        ready: list[str] = []
        failed: dict[str, str] = {}
        for rid, n in zip(so.req_ids, so.num_scheduled_tokens):
            prompt = self._prompts.get(rid)
            if prompt is None:
                failed[rid] = "the pooling runner does not know this request"
                continue
            prompt.num_scheduled += n
            if prompt.num_scheduled >= len(prompt.token_ids):
                ready.append(rid)
        pooled: dict[str, np.ndarray] = {}
        if ready:
            try:
                pooled = self._encode(ready)
            except (RuntimeError, ValueError) as exc:  # reported to these requests only
                logger.warning("encoding %d prompt(s) failed: %s", len(ready), exc)
                failed.update({rid: f"encoding failed: {exc}" for rid in ready})
        for rid in ready:
            self._prompts.pop(rid, None)
        return ModelRunnerOutput(pooled=pooled, failed=failed)

    def _encode(self, req_ids: list[str]) -> dict[str, np.ndarray]:
        assert self.model is not None
        prompts = [self._prompts[r].token_ids for r in req_ids]
        lengths = np.fromiter((len(p) for p in prompts), np.int64, len(prompts))
        # Similar lengths share a padded batch, so short prompts don't pay for long ones.
        order = np.argsort(lengths, kind="stable")
        out: dict[str, np.ndarray] = {}
        budget = max(self.config.scheduler.max_num_batched_tokens, int(lengths.max()))
        start = 0
        while start < len(order):
            end = start
            # A padded batch of the longest member's width stays within the token budget.
            while end < len(order) and (end - start + 1) * lengths[order[end]] <= budget:
                end += 1
            end = max(end, start + 1)
            idx = order[start:end]
            width = int(lengths[idx].max())
            ids = np.zeros((len(idx), width), dtype=np.int64)
            for row, i in enumerate(idx):
                ids[row, : lengths[i]] = prompts[i]
            vectors = self.model(torch.from_numpy(ids).to(self.device),
                                 torch.from_numpy(lengths[idx]).to(self.device))
            host = vectors.float().cpu().numpy()
            for row, i in enumerate(idx):
                out[req_ids[i]] = host[row]
            start = end
        return out
