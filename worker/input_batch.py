"""The worker's persistent state of the requests it is running.

Each request owns one row of fixed-size numpy arrays (token ids, sampling parameters), kept across
steps: the EngineCore sends a request once, then only diffs (new blocks, computed-token counts),
and the worker appends the tokens it samples itself. Per-step inputs are then gathered from these
rows with vectorised indexing, never rebuilt request by request.

A token sampled by a step whose output has not reached the CPU yet (async scheduling) is a
*placeholder*: it is counted in ``num_tokens`` and stored as ``PLACEHOLDER`` until the output
arrives; the model runner takes such input tokens from the previous step's sampled ids on the
device instead.

The block table itself lives on the device (the runner owns it); rows here only log the block ids
they gained since the last step (``take_block_updates``), so each step ships only what changed.
With several KV groups (``engine_core.kv_groups``) every group has its own table: the device keeps
them one after the other, each ``max_num_reqs * max_blocks_per_req + 1`` entries long.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from tidal.engine_core.protocol import NewRequestData
from tidal.engine_core.sampling_params import SamplingParams

PLACEHOLDER = -1  # token id not known on the CPU yet (sampled by a step still in flight)


@dataclass(slots=True)
class RowExtras:
    """Per-request values that do not fit a dense array."""

    req_id: str
    params: SamplingParams
    prompt_logprobs_from: int
    logit_bias: tuple[np.ndarray, np.ndarray] | None  # (token ids, biases)
    stop_ids: np.ndarray  # tokens banned until min_tokens is reached
    allowed_ids: np.ndarray | None = None  # the only tokens it may sample (allowed_token_ids)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 eos_token_ids: tuple[int, ...], num_kv_groups: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_blocks_per_req = max_blocks_per_req
        self.num_kv_groups = num_kv_groups
        # Flat offset of group g's table in the device's tables (see the module docstring).
        self.group_stride = max_num_reqs * max_blocks_per_req + 1
        self.eos_token_ids = np.asarray(eos_token_ids, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        # Bumped whenever a request joins or leaves, so ``rows_of`` knows when its last answer
        # still holds.
        self._membership = 0
        self._rows_for: tuple[list[str], int, np.ndarray, bool] = (
            [], -1, np.zeros(0, np.int64), True)
        self.extras: list[RowExtras | None] = [None] * max_num_reqs
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # Bumped whenever a row changes hands, so late outputs of a step (async scheduling) are
        # never written into a row that a new request took meanwhile.
        self.generation = np.zeros(max_num_reqs, dtype=np.int64)

        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)  # placeholders included
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)  # group 0's table
        # Groups 1..'s (all of a request's tables have the same length).
        self.group_num_blocks = np.zeros((max(0, num_kv_groups - 1), max_num_reqs),
                                         dtype=np.int32)
        # (flat index of the first entry, block ids) written since the last
        # ``take_block_updates``.
        self._block_updates: list[tuple[int, list[int]]] = []

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
        # Rows whose sampling needs more than temperature (top-k/p, min-p, penalties, bias,
        # min_tokens, seeds, logprobs): a batch without any skips those metadata builders.
        self.special = np.zeros(max_num_reqs, dtype=bool)
        # Live rows using penalties (which read every generated token) / prompt logprobs:
        # while zero, a step skips those checks altogether.
        self.num_penalized = 0
        self.num_prompt_logprobs_rows = 0
        self._penalized = np.zeros(max_num_reqs, dtype=bool)

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
        if len(new.block_ids) > self.max_blocks_per_req:
            raise ValueError(f"{len(new.block_ids)} blocks exceed the block table")
        if len(new.group_block_ids) != self.num_kv_groups - 1:
            raise ValueError(f"{len(new.group_block_ids) + 1} KV group tables for "
                             f"{self.num_kv_groups} KV groups")
        bias = None
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias))
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"logit_bias token id outside the vocabulary [0, {vocab_size})")
            vals = np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias))
            bias = (ids, vals)
        allowed = None
        if p.allowed_token_ids is not None:
            allowed = np.unique(np.asarray(p.allowed_token_ids, dtype=np.int64))
            if allowed.size and (allowed[0] < 0 or allowed[-1] >= vocab_size):
                raise ValueError(f"allowed_token_ids holds a token id outside the vocabulary "
                                 f"[0, {vocab_size})")
        stop_ids = np.unique(np.concatenate((self.eos_token_ids,
                                             np.asarray(p.stop_token_ids, dtype=np.int64))))
        stop_ids = stop_ids[(stop_ids >= 0) & (stop_ids < vocab_size)]
        if not self._free_rows:
            raise ValueError(f"more than {self.max_num_reqs} concurrent requests")
        row = self._free_rows.pop()
        self.row_of[new.req_id] = row
        self._membership += 1
        self.generation[row] += 1
        self.extras[row] = RowExtras(new.req_id, p, new.prompt_logprobs_from, bias, stop_ids,
                                     allowed)

        self.token_ids[row, :n_prompt] = new.prompt_token_ids
        self.token_ids[row, n_prompt:n_prompt + n_out] = new.output_token_ids
        self.num_tokens[row] = n_prompt + n_out
        self.num_prompt_tokens[row] = n_prompt
        self.num_computed[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        if self.num_kv_groups > 1:
            self.group_num_blocks[:, row] = 0
            for g, ids in enumerate(new.group_block_ids, 1):
                self.append_blocks(row, ids, g)

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
        penalized = (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                     or p.repetition_penalty != 1.0)
        self._penalized[row] = penalized
        self.num_penalized += penalized
        self.num_prompt_logprobs_rows += p.prompt_logprobs is not None
        self.special[row] = bool(
            (0 < p.top_k < vocab_size) or p.top_p < 1.0 or p.min_p > 0.0
            or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or p.repetition_penalty != 1.0 or bias is not None or p.min_tokens > 0
            or (p.seed is not None and p.temperature > 0) or p.logprobs is not None
            or allowed is not None or bool(p.logits_processors)
        )

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self._membership += 1
        self.extras[row] = None
        self.special[row] = False
        self.num_penalized -= bool(self._penalized[row])
        self._penalized[row] = False
        self.num_prompt_logprobs_rows -= bool(self.num_prompt_logprobs[row] >= 0)
        self.num_prompt_logprobs[row] = -1
        self._free_rows.append(row)

    def reset_rows(self) -> None:
        """Hand rows out from 0 again, as a new batch does (the batch must hold nothing)."""
        if self.row_of:
            raise RuntimeError(f"the batch still holds {len(self.row_of)} request(s)")
        self._free_rows = list(range(self.max_num_reqs - 1, -1, -1))

    def rows_of(self, req_ids: list[str]) -> tuple[np.ndarray, bool]:
        """The rows of ``req_ids`` (-1 for ids the batch does not hold; int64, read-only) and
        whether the batch holds them all. Decode steps schedule the same requests in the same
        order step after step, so the last answer is kept and reused while neither the list
        nor the membership changed."""
        last_ids, membership, rows, all_known = self._rows_for
        if membership == self._membership and req_ids == last_ids:
            return rows, all_known
        row_of = self.row_of
        rows = np.array([row_of.get(r, -1) for r in req_ids], dtype=np.int64)
        rows.flags.writeable = False  # shared by the steps that reuse it
        all_known = not (rows < 0).any()
        self._rows_for = (list(req_ids), self._membership, rows, all_known)
        return rows, all_known

    def append_blocks(self, row: int, block_ids: list[int], group: int = 0) -> None:
        if not block_ids:
            return
        counts = self.num_blocks if group == 0 else self.group_num_blocks[group - 1]
        n = int(counts[row])
        if n + len(block_ids) > self.max_blocks_per_req:
            raise ValueError(f"{n + len(block_ids)} blocks exceed the block table")
        start = row * self.max_blocks_per_req + n
        if group:
            start += group * self.group_stride
        self._block_updates.append((start, block_ids))
        counts[row] = n + len(block_ids)

    def take_block_updates(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Block-table entries written since the last call: (flat index group * group_stride +
        row * width + column, block id), or None when nothing changed."""
        ups = self._block_updates
        if not ups:
            return None
        self._block_updates = []
        if all(len(u[1]) == 1 for u in ups):  # decode steps: one new block per request
            flat = np.array([u[0] for u in ups], dtype=np.int64)
            vals = np.array([u[1][0] for u in ups], dtype=np.int32)
        elif len(ups) == 1:
            start, ids = ups[0]
            flat = np.arange(start, start + len(ids), dtype=np.int64)
            vals = np.asarray(ids, dtype=np.int32)
        else:
            lens = np.fromiter((len(u[1]) for u in ups), np.int64, len(ups))
            starts = np.fromiter((u[0] for u in ups), np.int64, len(ups))
            # start of each run, repeated over the run, plus the offset inside the run
            offsets = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(
                np.cumsum(lens) - lens, lens)
            flat = np.repeat(starts, lens) + offsets
            vals = np.fromiter(itertools.chain.from_iterable(u[1] for u in ups), np.int32,
                               int(lens.sum()))
        return flat, vals

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        if n < self.token_ids.shape[1]:
            self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1

    def append_placeholders(self, rows: np.ndarray) -> np.ndarray:
        """Count one token of each row as sampled with its value still unknown; returns the
        positions those tokens take."""
        pos = self.num_tokens[rows]
        if pos.max(initial=0) < self.token_ids.shape[1]:
            self.token_ids[rows, pos] = PLACEHOLDER
        else:
            inside = pos < self.token_ids.shape[1]
            self.token_ids[rows[inside], pos[inside]] = PLACEHOLDER
        self.num_tokens[rows] = pos + 1
        return pos

    @property
    def membership(self) -> int:
        """Changes whenever a request joins or leaves (rows change hands only then)."""
        return self._membership

    def fill_placeholders(self, rows: np.ndarray, positions: np.ndarray,
                          generations: np.ndarray, tokens: np.ndarray,
                          membership: int | None = None) -> None:
        """Write sampled values over their placeholders, skipping rows that changed hands
        (``generations``: the rows' generations when they sampled; ``membership``: the batch's
        then, if known: unchanged since, no row changed hands)."""
        width = self.token_ids.shape[1]
        if membership == self._membership and positions.max(initial=0) < width:
            self.token_ids[rows, positions] = tokens
            return
        ok = (self.generation[rows] == generations) & (positions < width)
        if ok.all():
            self.token_ids[rows, positions] = tokens
        else:
            self.token_ids[rows[ok], positions[ok]] = tokens[ok]
