"""The KV connector API: how KV cache blocks enter and leave an engine's KV pool.

A connector is one class (vLLM's ``KVConnectorBase_V1`` shape, loosely) built twice: once in the
EngineCore process with ``KVConnectorRole.SCHEDULER`` and once in every worker process with
``KVConnectorRole.WORKER``. The two halves talk only through the step message: the scheduler
side's ``build_connector_meta`` returns a msgspec ``KVConnectorMetadata`` that travels (msgpack,
never pickle) inside ``SchedulerOutput.kv_connector_metadata`` to the workers, and the worker
side's ``get_finished`` ids travel back in ``ModelRunnerOutput.kv_finished_sending`` /
``kv_finished_recving``.

Where tidal calls each method (fixed points; with no connector configured each is one
``is None`` test on the hot path):

scheduler side (``engine_core/scheduler.py``), per step:
  1. admitting a waiting request, after the local prefix-cache lookup:
     ``get_num_new_matched_tokens`` -> blocks are allocated for the local hit + the external
     tokens + this step's new tokens -> ``update_state_after_alloc`` (block ids of the whole
     request, group 0). External tokens count as computed (a prefix hit).
  2. a cached block reused for another hash (``BlockPool`` eviction), for connectors whose
     ``wants_evictions`` is True: ``on_block_evicted`` (the host tier saves it if it lacks
     it); a block registered in the prefix cache, for those whose ``wants_cached_blocks`` is
     True: ``on_block_cached`` (the host tier's write-through).
  3. end of ``schedule``: ``build_connector_meta``. A step whose metadata is empty (encodes
     like ``metadata_type()``) while no finished request's blocks are held travels as b"": the
     workers make no connector call at all that step (not even ``get_finished``), so a
     connector with transfers in flight says so in its metadata.
  4. a request finishing: ``request_finished``; True keeps its blocks held until a worker reports
     the save done (``update_connector_output`` with the id in ``finished_sending``).
  5. after every step's output: ``update_connector_output``; stats: ``take_stats``.

worker side (``worker/model_runner.py``), per step with tokens to compute:
  1. before the forward: ``start_load_kv(meta)`` then ``wait_for_layer_load(i)`` for every
     layer i of this stage (the loads finish before the forward runs: CUDA graphs replay whole
     forwards, so per-layer waits inside attention are not wired yet);
  2. after the forward: ``save_kv_layer(i, kv_caches[i], meta)`` for every layer, then
     ``wait_for_save()`` (saving after the forward for all layers, not per layer inside it);
  3. ``get_finished(finished_req_ids)`` -> (sending done, receiving done) ids.
  ``register_kv_caches`` once, after the KV cache is allocated.

Request ids in ``get_finished``: an id in ``finished_sending`` means its held blocks may be freed
(step 4 above); an id in ``finished_recving`` ends that request's asynchronous load. With tensor
or pipeline parallelism only the output rank's ids reach the scheduler.

Asynchronous loads (``get_num_new_matched_tokens`` returns ``(n, True)``): the scheduler
allocates the request's blocks for its local hit and the ``n`` loaded tokens (kept out of the
prefix cache until filled), hands them to ``update_state_after_alloc`` and parks the request
outside the batch; steps keep carrying the connector's metadata (``get_finished`` is asked every
step) until a worker reports the request in ``finished_recving``; it is then admitted from the
queue's head with those tokens computed. A load that failed is reported in ``finished_recving``
too, with its blocks in ``get_block_ids_with_load_errors`` of the same step: the request then
recomputes its prompt (ask it nothing again: a connector tries a request once). A request
aborted mid-load keeps its blocks until its load is reported. Not with several KV groups (such a
request fails alone with an error). A count that is not whole blocks leaving one token fails
that request alone too; the engine goes on.

Synchronous loads (``(n, False)``) are done in ``start_load_kv`` of the step that first schedules
the request; one that fails there reports its blocks through
``get_block_ids_with_load_errors``: the scheduler drops that step's output of the requests on
them and recomputes them.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

if TYPE_CHECKING:
    import torch

    from tidal.engine_core.config import EngineConfig
    from tidal.engine_core.protocol import SchedulerOutput
    from tidal.engine_core.request import Request


class KVConnectorRole(enum.IntEnum):
    SCHEDULER = 0  # the EngineCore process: decides what moves
    WORKER = 1  # each worker process: moves the tensors


class KVConnectorMetadata(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the scheduler side tells the worker side about one step. Connectors subclass it
    (msgspec fields only: it is msgpack-encoded into the step message)."""


class KVConnectorStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Counters since the previous ``take_stats``, in tokens: looked up beyond the local prefix
    cache, found there (loaded instead of recomputed), and saved out of the pool."""

    queries: int = 0
    hits: int = 0
    stores: int = 0


class KVConnectorBase:
    """Base of every KV connector. Defaults do nothing, so a connector overrides only the hooks
    it needs; ``get_num_new_matched_tokens`` must be overridden."""

    # The struct ``build_connector_meta`` returns; the worker side decodes the step's bytes as it.
    metadata_type: ClassVar[type[KVConnectorMetadata]] = KVConnectorMetadata
    # Whether the scheduler side wants ``on_block_evicted`` calls (installed on the block pool
    # only then, so other connectors cost nothing on eviction).
    wants_evictions: ClassVar[bool] = False
    # Whether it wants ``on_block_cached`` calls (the block pool's ``on_cache`` hook).
    wants_cached_blocks: ClassVar[bool] = False
    # Scheduler side: how long one asynchronous load may take before the scheduler gives its
    # request up (failed with an error; its blocks stay held until the workers report the load
    # over). None: no deadline.
    async_load_timeout_s: float | None = None

    def __init__(self, config: EngineConfig, role: KVConnectorRole, rank: int = 0) -> None:
        """``config``: the whole engine config (``config.kv_transfer`` is this connector's
        section); ``rank``: the worker's global rank (0 on the scheduler side)."""
        assert config.kv_transfer is not None
        self.config = config
        self.transfer_config = config.kv_transfer
        self.role = role
        self.rank = rank
        self.block_size = config.cache.block_size

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        """Refuse (``ValueError`` naming the field) an engine config this connector cannot
        serve, e.g. a combination it does not support yet; called once at config time."""

    # --- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens of ``request`` beyond its first ``num_computed_tokens`` (the local
        prefix-cache hit, a multiple of the block size) this connector can supply, and whether
        the load is asynchronous (True: the request waits, blocks held, until a worker reports
        it in ``finished_recving``; False: the worker loads them in ``start_load_kv`` of the step
        that first schedules the request). The count must be a multiple of the block size and
        leave at least one prompt token to compute (its logits are sampled)."""
        raise NotImplementedError

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """Blocks are allocated for an admitted request: ``block_ids`` is its whole block table
        (group 0); blocks ``[num_computed_tokens // block_size, + num_external_tokens //
        block_size)`` are the ones to fill from outside (``num_external_tokens`` may be 0)."""

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        """(Only when ``wants_evictions``.) Pool block ``block_id``, cached under
        ``block_hash``, is being reused for other tokens this step: its content is still intact
        until this step's forward writes it (workers copy out in ``start_load_kv``)."""

    def on_block_cached(self, block_id: int, block_hash: bytes) -> None:
        """(Only when ``wants_cached_blocks``.) Pool block ``block_id`` was registered in the
        prefix cache under ``block_hash`` this step: its K/V are complete once this step's
        forward ran (the host tier copies it out after that forward: write-through)."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's instructions to the worker side (called at the end of every ``schedule``
        that runs a step); it also resets the per-step state the scheduler side gathered."""
        return self.metadata_type()

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """``request`` finished (stopped, aborted or failed). Returns (whether its blocks are
        freed later — held until a worker puts its id in ``finished_sending`` — and the
        ``kv_transfer_params`` to hand the client, or None)."""
        return False, None

    def update_connector_output(self, finished_sending: list[str],
                                finished_recving: list[str]) -> None:
        """The workers' ``get_finished`` ids of one step, after the scheduler acted on them."""

    def take_stats(self) -> KVConnectorStats | None:
        """Counters since the last call (None: nothing to report)."""
        return None

    def reset_cache(self) -> bool:
        """Forget what the connector holds for prefix reuse (``reset_prefix_cache``); False if
        it cannot now."""
        return True

    # --- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """This worker's KV cache tensors, one per attention layer of its stage in layer order
        (``[2, num_blocks, block_size, kv_heads, head_dim]``, or MLA's latent layout: dim 1 is
        the block index in the standard layout). Called once, after allocation."""

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Begin this step's transfers into (and, for the host tier, out of) the pool, before
        the forward. Must not return before copies out of blocks this step overwrites are
        ordered before the forward's writes."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s loads for this step are usable by the forward."""

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor,
                      metadata: KVConnectorMetadata) -> None:
        """Layer ``layer_idx``'s cache after this step's forward wrote it: start saving what
        ``metadata`` asks for (may be asynchronous)."""

    def wait_for_save(self) -> None:
        """Block until this step's saves no longer need the pool blocks (called after every
        layer's ``save_kv_layer``, before the next step may overwrite them)."""

    def get_finished(self, finished_req_ids: list[str]) -> tuple[set[str], set[str]]:
        """(Requests whose asynchronous sends finished, requests whose asynchronous loads
        finished) since the last call. ``finished_req_ids``: requests the scheduler dropped
        this step."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Pool blocks that this step's synchronous loads failed to fill, since the last call
        (they travel back as ``ModelRunnerOutput.kv_invalid_block_ids``: the scheduler drops
        the outputs of the requests holding them and recomputes those requests)."""
        return set()

    # --- both ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Release sockets, threads and buffers (engine shutdown)."""
