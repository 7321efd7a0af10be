"""The worker's side of speculative decoding, around the model runner's step:

1. ``write_drafts``: the drafts the scheduler sent for this step become the inputs after each
   request's last token (in its row of the persistent batch, past ``num_tokens``: they are not
   the request's tokens until accepted).
2. ``logits_rows`` / ``verify_sampling``: every verify position of a sampling request gives
   logits, and the sampling metadata has one row per verify position (each seeded position its
   own generator, seeded for the token index it samples).
3. ``verify``: the rejection sampler, one copy of its padded result to the host, the emitted
   tokens appended to the rows.
4. ``propose``: the next drafts from each request's tokens (n-gram lookup on the host, or a
   draft model / EAGLE-3 head: ``model_drafter``), except for requests whose sampling at later
   positions would need what the verify step does not model: penalties (they count earlier
   outputs) and min_tokens not yet reached (stop tokens banned at some positions only).

With async scheduling and drafts kept on the device (a model drafter, or the n-gram lookup on
the device), ``launch_verify`` replaces ``verify``: the next step is scheduled while this one
runs, and its ``execute_model`` first takes this one's emitted tokens (``finish_verify``),
steps the scheduler's optimistic computed counts back by the rejected drafts (``step_back``)
and fills its placeholder drafts from the proposal left on the device (``write_drafts``,
``fill_device_drafts``).

For the model methods the runner also calls ``aux_hidden_spec`` (the target records what an
EAGLE-3 head or an MTP layer reads), ``load_drafter`` after the target is loaded, ``bind_kv_cache`` with the
pool, and ``observe`` after each forward pass (``propose`` with no rows after a step that
samples nothing: an EAGLE-3 head still reads a prompt chunk's hidden states).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tidal.engine_core.config import EngineConfig, ModelConfig
from tidal.engine_core.protocol import LogprobsArrays
from tidal.engine_core.speculative_config import SpeculativeConfig, ngram_history_bytes
from tidal.worker.attention.backend import AttentionImpl
from tidal.worker.input_batch import InputBatch
from tidal.worker.models.decoder import AuxHiddenSpec
from tidal.worker.ops.kernels import Kernels
from tidal.worker.sample.grammar_mask import grammar_slice
from tidal.worker.sample.metadata import (
    SamplingMetadata,
    SamplingMetadataBuilder,
    Stage,
    position_seed,
)
from tidal.worker.sample.rejection_sampler import (
    RejectionOutput,
    RejectionSampler,
    verify_layout,
)
from tidal.worker.sample.sampler import compute_logprobs
from tidal.worker.spec_decode.model_drafter import ModelDrafter
from tidal.worker.spec_decode.ngram_device import NgramDeviceProposer
from tidal.worker.spec_decode.ngram_proposer import NgramProposer
from tidal.worker.spec_decode.proposal import Proposal
from tidal.worker.step_buffers import to_host

logger = logging.getLogger(__name__)


def _emitted(both: np.ndarray) -> list[list[int]]:
    """Each request's emitted tokens from the rejection sampler's ``[B, K + 2]`` output on the
    host (the tokens, -1 padded, then their count)."""
    tokens, counts = both[:, :-1], both[:, -1]
    return [tokens[i, :counts[i]].tolist() for i in range(len(both))]


@dataclass(slots=True, eq=False)
class VerifyLaunch:
    """A verification launched on the device, its emitted tokens on their way to the host
    (async scheduling: collected when the next step is launched, or its output asked for)."""

    step_id: int
    sample_rows: np.ndarray
    sampled_ids: list[str]
    drafts: list[list[int]]
    emitted: torch.Tensor  # int64 [B, K + 2] on the host: the tokens, then their count
    copied: torch.cuda.Event | None


class SpeculativeStep:
    def __init__(self, config: SpeculativeConfig, device: torch.device, *,
                 max_num_reqs: int, max_model_len: int,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.config = config
        self.device = device
        # N-gram lookup: on a GPU batched on the device (a copy of the rows' tokens there),
        # else on the host; the model methods' drafter comes with ``load_drafter``.
        self.proposer: NgramProposer | None = None
        self.device_proposer: NgramDeviceProposer | None = None
        if not config.uses_model:
            args = (config.num_speculative_tokens, config.prompt_lookup_min,
                    config.prompt_lookup_max)
            if config.prompt_lookup_on_device:
                self.device_proposer = NgramDeviceProposer(*args, max_num_reqs, max_model_len,
                                                           device)
                logger.info("n-gram lookup on the device (a %.0f MiB copy of the batch rows' "
                            "tokens)", ngram_history_bytes(max_num_reqs, max_model_len) / 2**20)
            else:
                self.proposer = NgramProposer(*args)
        self.drafter: ModelDrafter | None = None
        self._draft_config: ModelConfig | None = None  # the draft's (model methods)
        # ``argmax``: the worker's (``Kernels.argmax``: few rows on the GPU in a two-stage
        # kernel, where torch's one block a row took 29-37 us over a 128k vocabulary).
        self.sampler = RejectionSampler(
            config.synthetic_conditional_rates if config.synthetic else None, argmax=argmax)
        # Seeded rows: one generator per (batch row, verify position), reseeded every step.
        self._generators: dict[tuple[int, int], torch.Generator] = {}
        # This step's verify layout, staged with its inputs by ``verify_sampling`` (one copy
        # with the rest, no host wait for the forward pass): (drafts, index, draft ids, counts).
        self._staged: tuple[list[list[int]], torch.Tensor, torch.Tensor, torch.Tensor] | None \
            = None
        # The drafts of each request verifying this step (-1: a draft only the device knows,
        # the drafter's output after the step before: ``write_drafts``).
        self._step_drafts: dict[str, list[int]] = {}
        # Row -> (its first draft's position, that draft's index in the flattened device
        # proposal), for this step's drafts taken from the device.
        self._from_device: dict[int, tuple[int, int]] = {}
        self._device_drafts: torch.Tensor | None = None
        # Where those drafts sit in the staged verify layout's draft ids (``_staged``).
        self._staged_unknown: torch.Tensor | None = None
        # The step's input ids and which of them were drafts from the device, for a
        # request-by-request verification (``_verify_each``).
        self._filled: tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray] | None = None
        # What the drafter proposed after the last step that did (``write_drafts``).
        self.proposal: Proposal | None = None
        # The last verification: drafts each batch row had rejected (the scheduler counted
        # them accepted if it scheduled the next step before seeing it:
        # ``SchedulerOutput.spec_in_flight``), its step id, and the requests it failed.
        self.rejected = np.zeros(0, dtype=np.int32)
        self.rejected_step = -1
        self.failed_ids: set[str] = set()

    # --- start-up (model methods) ----------------------------------------------------------

    def _draft_model_config(self, engine: EngineConfig) -> ModelConfig:
        from tidal.worker.spec_decode.draft_proposer import draft_model_config

        if self._draft_config is None and self.config.method == "mtp":
            # The target's own checkpoint (or dummy weights), read by the MTP layer's model.
            import msgspec

            from tidal.engine_core.model_registry import mtp_arch

            target = engine.model
            self._draft_config = msgspec.structs.replace(target, arch=mtp_arch(target.arch))
        if self._draft_config is None:
            assert self.config.model is not None
            target = engine.model
            # Random weights for the target mean random weights for the draft too.
            fmt = "dummy" if target.load_format == "dummy" else "auto"
            self._draft_config = draft_model_config(self.config.model, target, load_format=fmt)
        return self._draft_config

    def aux_hidden_spec(self, engine: EngineConfig, max_tokens: int) -> AuxHiddenSpec | None:
        """What the target must record for an EAGLE-3 head (its aux layers) or an MTP layer
        (the final hidden state: layer ``num_layers``); None for other methods."""
        if self.config.method == "mtp":
            return AuxHiddenSpec((engine.model.arch.num_layers,), max_tokens)
        if self.config.method != "eagle3":
            return None
        from tidal.worker.models.eagle3 import aux_layer_ids

        head = self._draft_model_config(engine).arch
        return AuxHiddenSpec(aux_layer_ids(head, engine.model.arch.num_layers), max_tokens)

    def load_drafter(self, engine: EngineConfig, target: torch.nn.Module, impl: AttentionImpl,
                     *, max_num_reqs: int, max_num_tokens: int, block_table: torch.Tensor,
                     kernels: Kernels | None = None) -> None:
        """Load the draft model / EAGLE-3 head next to ``target`` (model methods only), built
        with the target's attention backend and fused ops."""
        if not self.config.uses_model:
            return
        from tidal.worker.loader.model_loader import load_model
        from tidal.worker.spec_decode.draft_proposer import DraftModelProposer, Eagle3Proposer

        if engine.kv_layout().num_groups > 1:
            raise ValueError(f"speculative method {self.config.method!r} with a target of "
                             "several KV cache groups (sliding-window layers) is not yet "
                             "implemented in tidal")
        dcfg = self._draft_model_config(engine)
        model = load_model(dcfg, self.device, impl, kernels=kernels)
        k = self.config.num_speculative_tokens
        max_len = engine.model.max_model_len
        if self.config.method == "eagle3":
            proposer = Eagle3Proposer(model, k, target, max_len)  # type: ignore[arg-type]
        elif self.config.method == "mtp":
            from tidal.worker.spec_decode.mtp_proposer import MTPProposer

            proposer = MTPProposer(model, k, target, max_len)  # type: ignore[arg-type]
        else:
            proposer = DraftModelProposer(model, k, engine.model.arch, max_len)
        if kernels is not None:
            proposer.argmax = kernels.argmax
        self.drafter = ModelDrafter(self.config, proposer, max_num_reqs=max_num_reqs,
                                    max_num_tokens=max_num_tokens,
                                    block_size=engine.cache.block_size,
                                    block_table=block_table, device=self.device,
                                    aux_buffer=getattr(target, "aux_hidden_states", None))
        logger.info("speculative %s: draft %s loaded (%s)", self.config.method, dcfg.path,
                    self.config.draft_summary or dcfg.arch.architecture)

    def draft_weight_bytes(self, engine: EngineConfig, impl: AttentionImpl,
                           kernels: Kernels | None = None) -> int:
        """The draft's weights (model methods; built on the meta device), for the runner's
        check that the weights fit before loading."""
        if not self.config.uses_model:
            return 0
        from tidal.worker.loader.model_loader import torch_dtype
        from tidal.worker.models.registry import build_model

        dcfg = self._draft_model_config(engine)
        with torch.device("meta"):
            shell = build_model(dcfg.arch, torch_dtype(dcfg.dtype), impl, kernels=kernels)
        seen = {id(p): p for p in shell.parameters()}
        return sum(p.numel() * p.element_size() for p in seen.values())

    def kv_bytes_per_block(self) -> int:
        """What one pool block costs in the draft's cache (0 without one)."""
        return self.drafter.kv_bytes_per_block() if self.drafter is not None else 0

    def scratch_bytes(self) -> int:
        return self.drafter.scratch_bytes() if self.drafter is not None else 0

    def capture_graphs(self, max_reqs: int) -> None:
        """CUDA graphs of the drafter's uniform propose steps (model methods)."""
        if self.drafter is not None:
            self.drafter.capture_graphs(max_reqs)

    def bind_kv_cache(self, num_blocks: int) -> None:
        if self.drafter is not None:
            self.drafter.bind_kv_cache(num_blocks)

    def release_kv_cache(self) -> None:
        if self.drafter is not None:
            self.drafter.release_kv_cache()

    def observe(self, rows: np.ndarray, cu: np.ndarray, seq_lens: np.ndarray,
                target: torch.nn.Module) -> None:
        """The target step just run (an EAGLE-3 head reads its hidden states)."""
        if self.drafter is not None:
            self.drafter.observe(rows, cu, seq_lens,
                                 getattr(target, "aux_hidden_states", None))

    # --- before the forward pass ------------------------------------------------------------

    def write_drafts(self, b: InputBatch, rows: np.ndarray, req_ids: list[str],
                     spec: dict[str, list[int]]) -> np.ndarray:
        """Put each request's drafts after its tokens; returns the draft count per request
        (int32, parallel to ``rows``). A list of -1s (``SchedulerOutput.spec_in_flight``)
        takes the drafts proposed after the step before: from the host if they are there,
        else -1s on the host, filled on the device (``device_draft_sources``)."""
        n = np.zeros(len(rows), dtype=np.int32)
        width = b.token_ids.shape[1]
        step_drafts = self._step_drafts
        step_drafts.clear()
        self._from_device.clear()
        self._device_drafts = self._staged_unknown = self._filled = None
        for i, rid in enumerate(req_ids):
            drafts = spec.get(rid)
            if not drafts:
                continue
            row = int(rows[i])
            start = int(b.num_tokens[row])
            if start + len(drafts) > width:
                raise ValueError(f"drafts of {rid} run past max_model_len")
            if drafts[0] < 0:
                drafts = self._proposed(b, row, start, len(drafts))
            b.token_ids[row, start:start + len(drafts)] = drafts
            n[i] = len(drafts)
            step_drafts[rid] = drafts
        return n

    def _proposed(self, b: InputBatch, row: int, start: int, n: int) -> list[int]:
        """``n`` drafts of ``row`` from the last proposal. Where it has none for the row (the
        scheduler's rules for placeholders make it propose at least as many) its last token
        is repeated: verification stays exact with any draft, it is only likely rejected."""
        p = self.proposal
        i = p.find(b, row) if p is not None else None
        if i is not None and p is not None:
            if p.host is not None:
                got = p.host[i][:n]
                if got:
                    return got + [got[-1]] * (n - len(got))
            elif p.src is not None and p.src[i] >= 0 and p.dev is not None:
                self._device_drafts = p.dev
                self._from_device[row] = (start, int(p.src[i]) * p.dev.shape[1])
                return [-1] * n
        return [int(b.token_ids[row, start - 1])] * n

    @property
    def has_device_drafts(self) -> bool:
        """Whether ``write_drafts`` left some of this step's drafts to the device."""
        return bool(self._from_device)

    def device_draft_sources(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """For the step's inputs the host does not know (``rows`` / ``positions``: drafts
        ``write_drafts`` left to the device), their indices in the flattened proposal."""
        found = self._from_device
        keys = np.fromiter(found, dtype=np.int64, count=len(found))
        at = np.array(list(found.values()), dtype=np.int64).reshape(-1, 2)
        order = np.argsort(keys)
        keys, at = keys[order], at[order]
        i = np.minimum(np.searchsorted(keys, rows), len(keys) - 1)
        missing = keys[i] != rows
        if missing.any():
            raise RuntimeError(f"an input token of batch row {int(rows[missing][0])} is unknown "
                               "and not a draft the device holds")
        return at[i, 1] + positions.astype(np.int64) - at[i, 0]

    def fill_device_drafts(self, input_ids: torch.Tensor, dst: torch.Tensor,
                           src: torch.Tensor, rows: np.ndarray, positions: np.ndarray) -> None:
        """Copy the device's drafts into the step's inputs (``dst``: their token indices) and
        into the staged verify layout's draft ids (in the same order: the sampling requests'
        drafts in step order)."""
        assert self._device_drafts is not None
        values = self._device_drafts.reshape(-1).index_select(0, src)
        input_ids.index_copy_(0, dst, values)
        if self._staged is not None and self._staged_unknown is not None:
            ids = self._staged[2]
            ids.view(-1).index_copy_(0, self._staged_unknown, values)
        self._filled = (input_ids, dst, rows, positions)

    def step_back(self, b: InputBatch, rows: np.ndarray, req_ids: list[str],
                  step_id: int) -> np.ndarray:
        """``SchedulerOutput.spec_in_flight``: the computed counts of ``rows`` (cached
        requests, -1: not held) assumed the step before accepted all its drafts; step them
        back by what it rejected. Returns the rows, -1 for requests that step failed (done
        with: they are dropped from this one)."""
        if self.rejected_step != step_id - 1:
            return rows  # this worker verified nothing in that step: nothing was rejected
        held = rows >= 0
        b.num_computed[rows[held]] -= self.rejected[rows[held]]
        if self.failed_ids:
            rows = rows.copy()
            for i, rid in enumerate(req_ids):
                if rid in self.failed_ids:
                    rows[i] = -1
        return rows

    def _record(self, b: InputBatch, step_id: int, rows: np.ndarray, req_ids: list[str],
                drafts: list[list[int]], emitted: list[list[int]]) -> None:
        if len(self.rejected) != b.token_ids.shape[0]:
            self.rejected = np.zeros(b.token_ids.shape[0], dtype=np.int32)
        else:
            self.rejected.fill(0)
        self.failed_ids = set()
        for row, rid, d, e in zip(rows.tolist(), req_ids, drafts, emitted):
            if e:
                self.rejected[row] = len(d) - len(e) + 1
            else:
                self.failed_ids.add(rid)
        self.rejected_step = step_id

    @staticmethod
    def logits_rows(cu: np.ndarray, sample_mask: np.ndarray, n_draft: np.ndarray) -> np.ndarray:
        """Token indices of the step whose logits are needed: each sampling request's last
        1 + drafts tokens (its verify positions), in order."""
        n_verify = n_draft[sample_mask].astype(np.int64) + 1
        ends = cu[1:][sample_mask].astype(np.int64)
        within = np.arange(int(n_verify.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(n_verify) - n_verify, n_verify)
        return np.repeat(ends - n_verify, n_verify) + within

    def verify_sampling(self, builder: SamplingMetadataBuilder, b: InputBatch,
                        sample_rows: np.ndarray, n_draft: np.ndarray,
                        stage: Stage) -> SamplingMetadata:
        """Sampling metadata with one row per verify position (``n_draft``: the sampling
        requests' draft counts)."""
        n_verify = n_draft.astype(np.int64) + 1
        expanded = np.repeat(sample_rows, n_verify)
        meta = builder.build(b, expanded, stage)
        if meta.generators:
            # The builder keys its generators by batch row, so the positions of one request
            # would share one; each position gets its own, seeded for the token it samples.
            offset = np.arange(len(expanded), dtype=np.int64) - np.repeat(
                np.cumsum(n_verify) - n_verify, n_verify)
            gens: dict[int, torch.Generator] = {}
            for i in meta.generators:
                row, j = int(expanded[i]), int(offset[i])
                gen = self._generators.get((row, j))
                if gen is None:
                    gen = self._generators[(row, j)] = torch.Generator(device=self.device)
                n_out = int(b.num_tokens[row]) - int(b.num_prompt_tokens[row])
                gen.manual_seed(position_seed(int(b.seed[row]), n_out + j))
                gens[i] = gen
            meta.generators = gens
        drafts = [b.token_ids[row, n:n + k].tolist() if k else []
                  for row, n, k in zip(sample_rows.tolist(), b.num_tokens[sample_rows].tolist(),
                                       n_draft.tolist())]
        lay = verify_layout(drafts)
        shape = lay.index.shape
        self._staged = (drafts, stage(lay.index.ravel(), torch.int64).view(shape),
                        stage(lay.draft_ids.ravel(), torch.int64).view(shape),
                        stage(lay.num_drafts, torch.int64))
        if self._from_device:  # (filled in by ``fill_device_drafts``)
            self._staged_unknown = stage(np.flatnonzero(lay.draft_ids.ravel() < 0),
                                         torch.int64)
        return meta

    # --- after the forward pass -------------------------------------------------------------

    def _early(self, b: InputBatch, sample_rows: np.ndarray, propose: bool
               ) -> Callable[[RejectionOutput], None] | None:
        """``propose`` follows the verification: a drafter may launch its proposal before the
        wait for the emitted tokens (``ModelDrafter.propose_early``)."""
        if not propose or self.drafter is None:
            return None
        drafter = self.drafter

        def early(out: RejectionOutput) -> None:
            drafter.propose_early(b, sample_rows, out.token_ids, out.num_emitted)

        return early

    def _take_staged(self, drafts: list[list[int]]) -> tuple | None:
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] != drafts:
            staged = None  # (not this step's: never expected)
        return staged

    def verify(self, b: InputBatch, logits: torch.Tensor, meta: SamplingMetadata,
               builder: SamplingMetadataBuilder, sample_rows: np.ndarray,
               sampled_ids: list[str], step_id: int, propose: bool = False
               ) -> tuple[list[list[int]], dict[str, str], LogprobsArrays | None]:
        """Run the rejection sampler over the step's verify logits, append the emitted tokens
        to the rows; returns each sampling request's tokens (empty for one that failed), the
        failures, and the logprobs of every emitted token in order (when asked for). A batch
        that fails is retried request by request, so only the requests that fail are dropped
        (their logprobs too, for that step, as ``ModelRunner._sample`` does)."""
        drafts = [self._step_drafts.get(rid, []) for rid in sampled_ids]
        staged = self._take_staged(drafts)
        try:
            emitted, logprobs = self._verify_batch(logits, meta, drafts, staged, sampled_ids,
                                                   self._early(b, sample_rows, propose))
            failed: dict[str, str] = {}
        except Exception as exc:  # noqa: BLE001 - isolated below, request by request
            logger.warning("batched verification failed (%s); isolating the failing "
                           "request(s)", exc)
            if self.drafter is not None:
                self.drafter.forget_early()
            emitted, failed = self._verify_each(b, logits, builder, sample_rows, sampled_ids,
                                                drafts, meta)
            logprobs = None
        self._record(b, step_id, sample_rows, sampled_ids, drafts, emitted)
        self._append(b, sample_rows, emitted)
        return emitted, failed, logprobs

    def launch_verify(self, b: InputBatch, logits: torch.Tensor, meta: SamplingMetadata,
                      sample_rows: np.ndarray, sampled_ids: list[str], step_id: int,
                      propose: bool = False) -> VerifyLaunch | None:
        """``verify`` without the wait: the rejection sampler (and an early proposal) on the
        device, the emitted tokens on their way to the host; ``finish_verify`` takes them.
        None where the step must be verified now (``verify``): logprobs asked for (they are
        picked by the emitted counts), or a launch that failed (isolated there)."""
        if meta.max_num_logprobs is not None:
            return None
        drafts = [self._step_drafts.get(rid, []) for rid in sampled_ids]
        staged = self._take_staged(drafts)
        try:
            out, _ = self._launch(logits, meta, drafts, staged, sampled_ids, None)
        except Exception:  # noqa: BLE001 - ``verify`` isolates the failing request(s)
            self._staged = staged
            return None
        host, copied = to_host(torch.cat((out.token_ids, out.num_emitted.unsqueeze(1)), dim=1))
        # The proposal after the copy: the host waits for the emitted tokens only, and
        # prepares the next step while the device drafts.
        early = self._early(b, sample_rows, propose)
        if early is not None:
            early(out)
        return VerifyLaunch(step_id, sample_rows, sampled_ids, drafts, host, copied)

    def finish_verify(self, b: InputBatch, launch: VerifyLaunch) -> list[list[int]]:
        """Wait for a launched verification's emitted tokens and append them to the rows."""
        if launch.copied is not None:
            launch.copied.synchronize()
        emitted = _emitted(launch.emitted.numpy())
        self._record(b, launch.step_id, launch.sample_rows, launch.sampled_ids, launch.drafts,
                     emitted)
        self._append(b, launch.sample_rows, emitted)
        return emitted

    def _launch(self, logits: torch.Tensor, meta: SamplingMetadata, drafts: list[list[int]],
                staged: tuple | None, req_ids: list[str] | None,
                early: Callable[[RejectionOutput], None] | None):
        lay = verify_layout(drafts)
        dev = logits.device
        if staged is not None:
            _, index, draft_ids, num_drafts = staged
        elif not lay.num_drafts.any():  # no drafts: made on the device, nothing copied
            index = torch.arange(len(drafts), device=dev).unsqueeze(1)
            draft_ids = torch.zeros_like(index)
            num_drafts = index.new_zeros(len(drafts))
        else:
            if (lay.draft_ids < 0).any():
                raise RuntimeError("drafts only the device knows need the staged layout")
            index, draft_ids, num_drafts = (torch.from_numpy(a).to(dev) for a in (
                lay.index, lay.draft_ids, lay.num_drafts))
        q = None
        if (self.drafter is not None and req_ids is not None and not meta.all_greedy
                and lay.num_drafts.any()):
            q = self.drafter.draft_probs(req_ids, drafts, logits.shape[1], draft_ids)
        out = self.sampler(logits, meta, index, draft_ids, num_drafts, q)
        if early is not None:
            early(out)
        return out, lay

    def _verify_batch(self, logits: torch.Tensor, meta: SamplingMetadata,
                      drafts: list[list[int]], staged: tuple | None = None,
                      req_ids: list[str] | None = None,
                      early: Callable[[RejectionOutput], None] | None = None
                      ) -> tuple[list[list[int]], LogprobsArrays | None]:
        out, lay = self._launch(logits, meta, drafts, staged, req_ids, early)
        dev = logits.device
        # The step's one wait for the device: the emitted tokens decide the next step.
        both = torch.cat((out.token_ids, out.num_emitted.unsqueeze(1)), dim=1).cpu().numpy()
        tokens, counts = both[:, :-1], both[:, -1]
        emitted = _emitted(both)
        if out.logprobs is None or meta.max_num_logprobs is None:
            return emitted, None
        # The emitted tokens' verify positions, request by request (row-major order).
        mask = np.arange(tokens.shape[1])[None, :] < counts[:, None]
        rows = torch.from_numpy(lay.index[mask]).to(dev)
        chosen = torch.from_numpy(tokens[mask]).to(dev)
        lp = compute_logprobs(out.logprobs[rows], chosen, meta.max_num_logprobs)
        return emitted, LogprobsArrays(lp.token_ids.to(torch.int32).cpu().numpy(),
                                       lp.logprobs.cpu().numpy(),
                                       lp.ranks.to(torch.int32).cpu().numpy())

    def _verify_each(self, b: InputBatch, logits: torch.Tensor,
                     builder: SamplingMetadataBuilder, sample_rows: np.ndarray,
                     sampled_ids: list[str], drafts: list[list[int]], meta: SamplingMetadata
                     ) -> tuple[list[list[int]], dict[str, str]]:
        dev = self.device

        def direct(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(arr)).to(dev, dtype=dtype)

        if self._filled is not None:
            # Drafts only the device knew: on the host now, for the per-request layouts.
            input_ids, dst, rows, positions = self._filled
            b.token_ids[rows, positions] = input_ids.index_select(0, dst).cpu().numpy()
            drafts = [b.token_ids[row, n:n + len(d)].tolist() if d else []
                      for row, n, d in zip(sample_rows.tolist(),
                                           b.num_tokens[sample_rows].tolist(), drafts)]
        emitted: list[list[int]] = []
        failed: dict[str, str] = {}
        start = 0
        for i, rid in enumerate(sampled_ids):
            n = len(drafts[i]) + 1
            try:
                one = self.verify_sampling(builder, b, sample_rows[i:i + 1],
                                           np.array([len(drafts[i])]), direct)
                one.grammar_bitmask, one.grammar_rows = grammar_slice(
                    meta.grammar_bitmask, meta.grammar_rows, start, n)
                tokens, _ = self._verify_batch(logits[start:start + n], one,
                                               drafts[i:i + 1], None, [rid])
                emitted.append(tokens[0])
            except Exception as exc:  # noqa: BLE001 - reported to that request only
                failed[rid] = f"sampling failed: {exc}"
                emitted.append([])
            start += n
        self._staged = None  # (what the per-request metadata above staged)
        return emitted, failed

    @staticmethod
    def _append(b: InputBatch, rows: np.ndarray, emitted: list[list[int]]) -> None:
        counts = np.fromiter((len(e) for e in emitted), dtype=np.int64, count=len(emitted))
        if not counts.any():
            return
        starts = b.num_tokens[rows].astype(np.int64)
        flat = np.fromiter((t for e in emitted for t in e), dtype=np.int32,
                           count=int(counts.sum()))
        row_of = np.repeat(rows, counts)
        pos = np.repeat(starts, counts) + np.arange(len(flat), dtype=np.int64) - np.repeat(
            np.cumsum(counts) - counts, counts)
        inside = pos < b.token_ids.shape[1]
        b.token_ids[row_of[inside], pos[inside]] = flat[inside]
        b.num_tokens[rows] = starts + counts

    def propose(self, b: InputBatch, rows: np.ndarray, emitted: list[list[int]],
                defer: bool = False) -> Proposal:
        """The next step's drafts of each request of ``rows`` (that emitted tokens now);
        ``defer``: a drafter's uniform proposal stays on the device (``Proposal``)."""
        self.proposal = self._propose(b, rows, emitted, defer)
        return self.proposal

    def _propose(self, b: InputBatch, rows: np.ndarray, emitted: list[list[int]],
                 defer: bool) -> Proposal:
        n_tokens = b.num_tokens[rows]
        n_out = n_tokens - b.num_prompt_tokens[rows]
        exact = ((b.presence[rows] == 0) & (b.frequency[rows] == 0) & (b.repetition[rows] == 1)
                 & (n_out >= b.min_tokens[rows]))
        # Room left in the row: drafts past max_model_len could never be verified.
        room = b.max_model_len - n_tokens - 1
        limits = np.where(exact, np.minimum(room, self.config.num_speculative_tokens), 0)
        limits[np.array([not e for e in emitted], dtype=bool)] = 0
        if self.drafter is not None:
            return self.drafter.propose(b, rows, limits.astype(np.int64), defer)
        if self.device_proposer is not None:
            return self.device_proposer.propose(b, rows, n_tokens, limits, defer)
        assert self.proposer is not None
        return Proposal(rows, b.generation[rows].copy(),
                        host=self.proposer.propose(b.token_ids, rows, n_tokens, limits))

