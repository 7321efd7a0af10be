"""The worker's persistent state of the requests it is running.

Each request owns one row of fixed-size numpy arrays (token ids, block table, sampling
parameters), kept across steps: the EngineCore sends a request once, then only diffs (new blocks,
computed-token counts), and the worker appends the tokens it samples itself. Per-step inputs are
then gathered from these rows with vectorised indexing, never rebuilt request by request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tidal.engine_core.protocol import NewRequestData
from tidal.engine_core.sampling_params import SamplingParams


@dataclass(slots=True)
class RowExtras:
    """Per-request values that do not fit a dense array."""

    req_id: str
    params: SamplingParams
    prompt_logprobs_from: int
    logit_bias: tuple[np.ndarray, np.ndarray] | None  # (token ids, biases)
    stop_ids: np.ndarray  # tokens banned until min_tokens is reached


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.eos_token_ids = np.asarray(eos_token_ids, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.extras: list[RowExtras | None] = [None] * max_num_reqs
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition = np.ones(max_num_reqs, dtype=np.float32)
        self.seed = np.full(max_num_reqs, -1, dtype=np.int64)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.row_of)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.row_of

    def add(self, new: NewRequestData, vocab_size: int) -> None:
        """Take over a new (or resumed) request. Raises ValueError for a request this worker
        cannot run; nothing is changed then."""
        p = new.sampling_params
        n_prompt, n_out = len(new.prompt_token_ids), len(new.output_token_ids)
        if n_prompt + n_out > self.max_model_len:
            raise ValueError(f"{n_prompt + n_out} tokens exceed max_model_len "
                             f"{self.max_model_len}")
        if len(new.block_ids) > self.block_table.shape[1]:
            raise ValueError(f"{len(new.block_ids)} blocks exceed the block table")
        bias = None
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias))
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"logit_bias token id outside the vocabulary [0, {vocab_size})")
            vals = np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias))
            bias = (ids, vals)
        stop_ids = np.unique(np.concatenate((self.eos_token_ids,
                                             np.asarray(p.stop_token_ids, dtype=np.int64))))
        stop_ids = stop_ids[(stop_ids >= 0) & (stop_ids < vocab_size)]
        if not self._free_rows:
            raise ValueError(f"more than {self.max_num_reqs} concurrent requests")
        row = self._free_rows.pop()
        self.row_of[new.req_id] = row
        self.extras[row] = RowExtras(new.req_id, p, new.prompt_logprobs_from, bias, stop_ids)

        self.token_ids[row, :n_prompt] = new.prompt_token_ids
        self.token_ids[row, n_prompt:n_prompt + n_out] = new.output_token_ids
        self.num_tokens[row] = n_prompt + n_out
        self.num_prompt_tokens[row] = n_prompt
        self.num_computed[row] = new.num_computed_tokens
        self.block_table[row, :len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)

        self.temperature[row] = p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.presence[row] = p.presence_penalty
        self.frequency[row] = p.frequency_penalty
        self.repetition[row] = p.repetition_penalty
        self.seed[row] = -1 if p.seed is None else p.seed & 0x7FFF_FFFF_FFFF_FFFF
        self.min_tokens[row] = p.min_tokens
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.extras[row] = None
        self._free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        n = int(self.num_blocks[row])
        self.block_table[row, n:n + len(block_ids)] = block_ids
        self.num_blocks[row] = n + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        if n < self.token_ids.shape[1]:
            self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1
