"""P2pConnector: disaggregated prefill/decode between two engines of one host.

The producer (``kv_role: kv_producer``, the prefill instance) computes a request that carries
``kv_transfer_params: {"do_remote_decode": true}`` (the proxy sends it with ``max_tokens=1``),
keeps its KV blocks after it finishes (``request_finished`` returns True) and answers the client
with ``kv_transfer_params`` saying where they are: vLLM's shape, ``do_remote_prefill``,
``remote_engine_id``, ``remote_host``, ``remote_port``, ``remote_request_id``,
``remote_block_ids``, plus ``remote_num_tokens`` and ``remote_digest`` (a sha256 of the prompt
and adapter: the producer serves the KV only to a consumer whose prompt hashes the same, so a
client cannot load one prompt's KV under another prompt's cache entries). The proxy passes them
on in the decode request.

The consumer (``kv_consumer``, the decode instance) treats the producer's full prompt blocks like
a prefix hit (``get_num_new_matched_tokens``); its worker pulls them straight into the blocks the
scheduler allocated, over ``p2p_transport``. By default the pull is asynchronous
(``load_async``): the request waits, its blocks allocated, while a background thread of the
worker (``p2p_async_pull``) pulls and the other requests keep decoding; the workers report it
in ``finished_recving`` and it is scheduled from there like a prefix hit. A pull that fails or
times out (the producer died, refused, answered garbage) is reported with its blocks invalid:
the request recomputes its prompt, so the answer is never wrong, only later. With
``async_pull: false`` the pull runs inside ``start_load_kv`` of the step that first schedules
the request (a failure drops that step's output of it). Each request is tried once.

``kv_connector_extra_config``: ``transport`` ("zmq", the default: raw ZeroMQ frames staged
through host memory; "gloo": a two-rank gloo group per producer-consumer pair, host memory;
"nccl": a two-rank NCCL group, GPU cache to GPU cache, needs a CUDA engine on each side and
distinct GPUs; "auto": nccl when the KV cache is on a GPU, else zmq), ``nccl_streams`` (consumer,
NCCL communicators per pair, 1-4, default 2: a pull's sends go round-robin over them so their
per-operation handshakes overlap), ``min_direct_bytes`` (both sides, default 512 KiB: runs of
blocks whose every K / V slice is at least this long go cache to cache over a gloo / nccl pair,
and a pull into one such run posts its receives before it asks), ``async_pull`` (consumer,
default true), ``pull_timeout_s`` (consumer, default 5: a dead producer costs a request this
long once, and with ``async_pull: false`` stalls that step as long), ``send_timeout_s`` (producer: blocks nobody pulls are released after this,
default 120), ``allowed_producers`` (consumer: ``"host:port"`` or ``"host"`` entries a decode
request's ``remote_host``/``remote_port`` may name besides loopback addresses; the values come
from clients, so any other address is refused, at the API with a 400 and again here, rather
than have the engine connect wherever a request says and load KV from whoever answers).
``kv_buffer_size`` bounds the producer's send buffer (bytes staged per chunk of a pull).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import uuid
from typing import TYPE_CHECKING, Any

import msgspec

from tidal.engine_core import envs
from tidal.engine_core.kv_transfer.connector_base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
)
from tidal.engine_core.protocol import FinishReason

if TYPE_CHECKING:
    import torch

    from tidal.engine_core.config import EngineConfig
    from tidal.engine_core.protocol import SchedulerOutput
    from tidal.engine_core.request import Request

logger = logging.getLogger(__name__)

_EXTRA_KEYS = ("transport", "pull_timeout_s", "send_timeout_s", "allowed_producers",
               "async_pull", "nccl_streams", "min_direct_bytes")
# A run of blocks whose every slice (one layer's K or V over the run) holds at least this many
# bytes goes cache to cache over a pair, and a pull into one such run posts its receives
# first; shorter runs are staged (a send costs a fixed overhead, staging two passes over its
# bytes). p2p_direct_runs.DIRECT_MIN_BYTES, kept here as a number: this module stays free of
# torch for the API server.
DEFAULT_MIN_DIRECT_BYTES = 512 * 1024
# NCCL communicators per producer-consumer pair (``p2p_pair_group.PairGroup``; its
# ``MAX_STREAMS`` is the same cap: this module stays free of torch for the API server).
# Default 2: on two H200s a 1 GiB posted pull moved 209-221 / 242-264 / 262-265 GB/s with
# 1 / 2 / 4, and each pair's NCCL buffers took 934 / 1,034 / 2,066 MiB of device memory outside
# the KV cache (allocated after the cache was sized): the second communicator costs 100 MiB
# for 16-19 %, the next two a GiB for little more. (Staged chunks, scattered blocks, measured
# 142 / 128 GB/s with 1 / 2 on two H100s.)
DEFAULT_NCCL_STREAMS = 2
MAX_STREAMS = 4
MAX_ALLOWED_PRODUCERS = 1024
_TRANSPORTS = ("zmq", "gloo", "nccl", "auto")
# kv_transfer_params a client may send (vLLM's names); the values are checked where used.
PARAM_KEYS = frozenset({
    "do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_host", "remote_port",
    "remote_request_id", "remote_block_ids", "remote_num_tokens", "remote_digest",
})
MAX_REQUEST_ID_LEN = 256


class SendSpec(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Producer: serve ``request_id``'s blocks (its table so far); ``ready`` once this step
    computes its last prompt token."""

    request_id: str
    block_ids: list[int]
    digest: str
    ready: bool = False


class LoadSpec(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Consumer: pull the producer's blocks [start_block, start_block + len(block_ids)) of
    ``remote_request_id`` into this pool's ``block_ids``, before this step's forward."""

    request_id: str
    address: str
    remote_request_id: str
    start_block: int
    block_ids: list[int]
    digest: str


class P2pMetadata(KVConnectorMetadata):
    sends: list[SendSpec] = []
    loads: list[LoadSpec] = []
    forget: list[str] = []  # producer: finished without a transfer (aborted, failed)


def prompt_digest(request: Request) -> str:
    """What both sides must agree on for the producer's KV to be this request's: its prompt
    tokens and its LoRA adapter (the same tokens under another adapter have other KV)."""
    h = hashlib.sha256()
    h.update(b",".join(str(t).encode() for t in request.prompt_token_ids))
    if request.lora_request is not None:
        h.update(b"\x00lora:" + request.lora_request.lora_name.encode())
    return h.hexdigest()


def resolve_transport(transport: str, kv_caches: list[torch.Tensor]) -> str:
    """The consumer's transport: "auto" is nccl for a GPU cache, else zmq."""
    if transport == "auto":
        return "nccl" if kv_caches and kv_caches[0].is_cuda else "zmq"
    return transport


class KVTransferParamsError(ValueError):
    """A request's kv_transfer_params are malformed; the message names the key."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_producer_allowed(params: dict[str, Any], allowed: list[str]) -> None:
    """Refuse a ``do_remote_prefill`` request whose producer address is neither loopback nor
    in ``allowed`` (``kv_connector_extra_config.allowed_producers``): clients supply it."""
    host, port = params.get("remote_host"), params.get("remote_port")
    if not params.get("do_remote_prefill") or host is None:
        return
    if _is_loopback(host) or host in allowed or f"{host}:{port}" in allowed:
        return
    raise KVTransferParamsError(
        f"kv_transfer_params.remote_host {host!r} (port {port}) is not an allowed producer: "
        "loopback addresses only, unless listed in --kv-transfer-config "
        "kv_connector_extra_config.allowed_producers")


def check_transfer_params(params: Any) -> None:
    """Reject malformed ``kv_transfer_params`` at the edge (the frontend calls this; the engine
    ignores a request whose params it cannot use and recomputes instead)."""
    if not isinstance(params, dict):
        raise KVTransferParamsError("kv_transfer_params must be an object")
    unknown = sorted(set(params) - PARAM_KEYS)
    if unknown:
        raise KVTransferParamsError(f"kv_transfer_params: unknown key(s) {', '.join(unknown)} "
                                    f"(known: {', '.join(sorted(PARAM_KEYS))})")
    for key in ("do_remote_decode", "do_remote_prefill"):
        if key in params and not isinstance(params[key], bool):
            raise KVTransferParamsError(f"kv_transfer_params.{key} must be a boolean")
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        raise KVTransferParamsError("kv_transfer_params: do_remote_decode and "
                                    "do_remote_prefill exclude each other")
    for key in ("remote_engine_id", "remote_host", "remote_request_id", "remote_digest"):
        value = params.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > MAX_REQUEST_ID_LEN):
            raise KVTransferParamsError(f"kv_transfer_params.{key} must be a string of at most "
                                        f"{MAX_REQUEST_ID_LEN} characters")
    for key in ("remote_port", "remote_num_tokens"):
        value = params.get(key)
        if value is not None and (type(value) is not int or value < 0 or value > 1 << 31):
            raise KVTransferParamsError(f"kv_transfer_params.{key} must be a non-negative "
                                        "integer")
    if params.get("remote_port") is not None and not 0 < params["remote_port"] < 65536:
        raise KVTransferParamsError("kv_transfer_params.remote_port must be in 1..65535")
    blocks = params.get("remote_block_ids")
    if blocks is not None and (not isinstance(blocks, list) or len(blocks) > 1 << 20
                               or not all(type(b) is int and b >= 0 for b in blocks)):
        raise KVTransferParamsError("kv_transfer_params.remote_block_ids must be a list of "
                                    "block ids")
    if params.get("do_remote_prefill"):
        missing = [k for k in ("remote_host", "remote_port", "remote_request_id",
                               "remote_num_tokens", "remote_digest") if params.get(k) is None]
        if missing:
            raise KVTransferParamsError("kv_transfer_params with do_remote_prefill needs "
                                        f"{', '.join(missing)} (the prefill side's answer)")


class P2pConnector(KVConnectorBase):
    metadata_type = P2pMetadata

    def __init__(self, config: EngineConfig, role: KVConnectorRole, rank: int = 0) -> None:
        super().__init__(config, role, rank)
        tc = self.transfer_config
        self.is_producer = tc.is_producer
        self.is_consumer = tc.is_consumer
        self.pull_timeout_s = float(tc.extra("pull_timeout_s", 5.0))
        self.allowed_producers: list[str] = list(tc.extra("allowed_producers", []))
        self.send_timeout_s = float(tc.extra("send_timeout_s", 120.0))
        self.transport = str(tc.extra("transport", "zmq"))
        self.async_pull = bool(tc.extra("async_pull", True))
        self.nccl_streams = int(tc.extra("nccl_streams", DEFAULT_NCCL_STREAMS))
        self.min_direct_bytes = int(tc.extra("min_direct_bytes", DEFAULT_MIN_DIRECT_BYTES))
        # One background pull: its own deadline (a pair's set-up and the transfer) plus a
        # margin; past it the scheduler gives the request up (a wedged pull thread or group).
        self.async_load_timeout_s = 2 * self.pull_timeout_s + 30.0
        self.engine_id = tc.engine_id or uuid.uuid4().hex[:16]
        self.address = f"tcp://{tc.kv_ip}:{tc.kv_port}"
        # scheduler side
        self._tried: set[str] = set()  # consumer: requests whose load was planned once
        self._planned: dict[str, tuple[str, str, int, int, str]] = {}  # rid -> pull target
        self._loads: list[LoadSpec] = []  # this step's
        # producer: rid -> (its block table so far, prompt digest, prompt length)
        self._tables: dict[str, tuple[list[int], str, int]] = {}
        self._ready: set[str] = set()  # producer: prompt computed (servable once run)
        self._held: set[str] = set()  # producer: finished, blocks held for the consumer
        self._forget: list[str] = []
        self._stats = KVConnectorStats()
        # worker side
        self._server = None
        self._client = None
        self._puller = None  # AsyncPuller: the consumer's background pulls
        self._step: P2pMetadata | None = None
        self._invalid: set[int] = set()
        self._failed_sync = 0

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        tc = config.kv_transfer
        assert tc is not None
        unknown = sorted(set(tc.kv_connector_extra_config) - set(_EXTRA_KEYS))
        if unknown:
            raise ValueError(f"--kv-transfer-config: kv_connector_extra_config has unknown "
                             f"key(s) {', '.join(unknown)} for P2pConnector (known: "
                             f"{', '.join(_EXTRA_KEYS)})")
        transport = tc.extra("transport", "zmq")
        if transport not in _TRANSPORTS:
            raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.transport must "
                             f"be one of {', '.join(_TRANSPORTS)}, got {transport!r}")
        if not tc.is_consumer:
            # The consumer picks the transport and pulls; a producer serves every transport.
            idle = [k for k in ("transport", "async_pull", "nccl_streams")
                    if k in tc.kv_connector_extra_config]
            if idle:
                logger.warning("--kv-transfer-config: kv_connector_extra_config %s has no "
                               "effect on a producer (the consumer picks the transport and "
                               "pulls)", ", ".join(idle))
        elif "nccl_streams" in tc.kv_connector_extra_config and transport in ("zmq", "gloo"):
            logger.warning("--kv-transfer-config: kv_connector_extra_config.nccl_streams has no "
                           "effect with transport %r (NCCL pairs only)", transport)
        elif transport == "nccl" and config.runner.device != "cuda":
            raise ValueError("--kv-transfer-config: kv_connector_extra_config.transport "
                             f"'nccl' needs a CUDA engine (this one runs on "
                             f"{config.runner.device}); use 'gloo' or 'zmq'")
        if not isinstance(tc.extra("async_pull", True), bool):
            raise ValueError("--kv-transfer-config: kv_connector_extra_config.async_pull must "
                             f"be true or false, got {tc.extra('async_pull')!r}")
        direct = tc.extra("min_direct_bytes", DEFAULT_MIN_DIRECT_BYTES)
        if isinstance(direct, bool) or not isinstance(direct, int) or not 1 <= direct <= 1 << 40:
            raise ValueError("--kv-transfer-config: kv_connector_extra_config.min_direct_bytes "
                             f"must be an integer of bytes in [1, 2**40], got {direct!r}")
        streams = tc.extra("nccl_streams", DEFAULT_NCCL_STREAMS)
        if isinstance(streams, bool) or not isinstance(streams, int) \
                or not 1 <= streams <= MAX_STREAMS:
            raise ValueError("--kv-transfer-config: kv_connector_extra_config.nccl_streams must "
                             f"be an integer in [1, {MAX_STREAMS}], got {streams!r}")
        allowed = tc.extra("allowed_producers", [])
        if not isinstance(allowed, list) or len(allowed) > MAX_ALLOWED_PRODUCERS \
                or not all(isinstance(a, str) and 0 < len(a) <= MAX_REQUEST_ID_LEN
                           for a in allowed):
            raise ValueError("--kv-transfer-config: kv_connector_extra_config.allowed_producers "
                             "must be a list of \"host:port\" or \"host\" strings, got "
                             f"{allowed!r}")
        for key in ("pull_timeout_s", "send_timeout_s"):
            value = tc.extra(key, 1.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value <= 3600:
                raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.{key} must "
                                 f"be seconds in (0, 3600], got {value!r}")
        if config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size > 1:
            raise ValueError("--kv-transfer-config: not yet supported: P2pConnector with tensor "
                             "or pipeline parallelism (one worker per engine)")
        if getattr(config.parallel, "data_parallel_size", 1) > 1:
            # (Every rank would bind the one kv_port.)
            raise ValueError("--kv-transfer-config: not yet supported: P2pConnector with data "
                             "parallelism (one engine per instance)")
        if config.kv_layout().hybrid:
            raise ValueError("--kv-transfer-config: not yet supported: P2pConnector with "
                             "sliding-window layers (several KV groups)")
        if config.speculative is not None:
            raise ValueError("--kv-transfer-config: not yet supported: P2pConnector with "
                             "speculative decoding (the drafter's KV is not transferred)")
        if not config.cache.enable_prefix_caching and tc.is_consumer:
            # (The loaded blocks are counted like prefix hits; nothing else needs the cache.)
            logger.info("P2pConnector consumer without prefix caching: loaded blocks are "
                        "used by their request only")

    # --- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        rid = request.request_id
        if not self.is_consumer or not params or not params.get("do_remote_prefill") \
                or rid in self._tried:
            return 0, False
        # (Marked tried once admitted, ``update_state_after_alloc``: an admission that finds
        # no room asks again later.)
        try:
            check_transfer_params(params)
            check_producer_allowed(params, self.allowed_producers)
        except KVTransferParamsError as exc:
            logger.warning("request %s: %s; computing its prompt here", rid, exc)
            return 0, False
        bs = self.block_size
        n_prompt = request.num_prompt_tokens
        remote_tokens = int(params["remote_num_tokens"])
        digest = prompt_digest(request)
        if remote_tokens != n_prompt or params["remote_digest"] != digest:
            logger.warning("request %s: its kv_transfer_params describe another prompt; "
                           "computing its prompt here", rid)
            return 0, False
        if request.sampling_params.prompt_logprobs is not None:
            return 0, False  # prompt logprobs need every prompt position's logits
        # Full blocks only, and at least one prompt token left to compute (its logits sample).
        full = (n_prompt - 1) // bs * bs
        external = max(0, full - num_computed_tokens)
        # Nothing to load (the local prefix cache has it all) still plans a release: the
        # producer need not hold the blocks until its timeout.
        address = f"tcp://{params['remote_host']}:{params['remote_port']}"
        self._planned[rid] = (address, str(params["remote_request_id"]),
                              num_computed_tokens // bs, external // bs, digest)
        return external, self.async_pull and external > 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        plan = self._planned.pop(rid, None)
        if plan is not None:
            self._tried.add(rid)  # a request is loaded once; after a failure it recomputes
            self._stats.queries += request.num_prompt_tokens
            address, remote_rid, start, count, digest = plan
            if num_external_tokens <= 0:
                count = 0  # a release only
            self._loads.append(LoadSpec(rid, address, remote_rid, start,
                                        list(block_ids[start:start + count]), digest))
            self._stats.hits += max(num_external_tokens, 0)
        params = request.kv_transfer_params
        if self.is_producer and params and params.get("do_remote_decode") is True:
            self._tables[rid] = (list(block_ids), prompt_digest(request),
                                 request.num_prompt_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        sends: list[SendSpec] = []
        if self._tables:
            so = scheduler_output
            cached = so.cached_reqs
            scheduled = so.scheduled()
            computed = dict(zip(cached.req_ids, cached.num_computed_tokens))
            for new in so.new_reqs:
                computed[new.req_id] = new.num_computed_tokens
            for k, blocks in zip(cached.new_block_index, cached.new_block_ids):
                entry = self._tables.get(cached.req_ids[k])
                if entry is not None:
                    entry[0].extend(blocks)
            for rid, (table, digest, n_prompt) in self._tables.items():
                n = scheduled.get(rid)
                if n is None:
                    continue
                ready = computed[rid] + n >= n_prompt
                if ready:
                    self._ready.add(rid)
                sends.append(SendSpec(rid, list(table), digest, ready))
        meta = P2pMetadata(sends=sends, loads=self._loads, forget=self._forget)
        self._loads, self._forget = [], []
        return meta

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._tried.discard(rid)
        self._planned.pop(rid, None)
        entry = self._tables.pop(rid, None)
        ready = rid in self._ready
        self._ready.discard(rid)
        if entry is None:
            return False, None
        if not ready or request.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
            self._forget.append(rid)
            return False, None
        # A prompt of less than one whole block plus a token has nothing a consumer loads.
        hold = (request.num_prompt_tokens - 1) // self.block_size > 0
        if hold:
            self._held.add(rid)
        else:
            self._forget.append(rid)
        tc = self.transfer_config
        return hold, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": tc.kv_ip,
            "remote_port": tc.kv_port,
            "remote_request_id": rid,
            "remote_block_ids": list(block_ids),
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_digest": entry[1],
        }

    def update_connector_output(self, finished_sending: list[str],
                                finished_recving: list[str]) -> None:
        self._held.difference_update(finished_sending)

    @property
    def num_held(self) -> int:
        """Producer: finished requests whose blocks wait for a consumer's pull."""
        return len(self._held)

    def take_stats(self) -> KVConnectorStats | None:
        stats = self._stats
        if not (stats.queries or stats.hits):
            return None
        self._stats = KVConnectorStats()
        return stats

    # --- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        from tidal.engine_core.kv_transfer.p2p_transport import KVPullClient, KVSendServer

        if self._server is not None or self._client is not None:  # allocated again
            for side in (self._server, self._client):
                if side is not None:
                    side.rebind(kv_caches)
            return
        auth = envs.kv_auth_key()
        if self.is_producer:
            self._server = KVSendServer(kv_caches, self.address,
                                        self.transfer_config.kv_buffer_size,
                                        self.send_timeout_s, self.min_direct_bytes,
                                        auth_key=auth)
        if self.is_consumer:
            self._client = KVPullClient(kv_caches, self.pull_timeout_s,
                                        resolve_transport(self.transport, kv_caches),
                                        self.nccl_streams, auth_key=auth,
                                        min_direct_bytes=self.min_direct_bytes)
            if self.async_pull:
                from tidal.engine_core.kv_transfer.p2p_async_pull import AsyncPuller

                self._puller = AsyncPuller(self._client)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        from tidal.engine_core.kv_transfer.p2p_transport import KVTransferError

        assert isinstance(metadata, P2pMetadata)
        self._step = metadata
        server = self._server
        if server is not None:
            for rid in metadata.forget:
                server.forget(rid)
            for spec in metadata.sends:
                # Ready only after this step's forward (``wait_for_save``) computed the blocks.
                server.register(spec.request_id, spec.block_ids, spec.digest, ready=False)
        client = self._client
        if client is None:
            return
        if self._puller is not None:
            from tidal.engine_core.kv_transfer.p2p_async_pull import PullJob

            for load in metadata.loads:
                self._puller.submit(PullJob(load.request_id, load.address,
                                            load.remote_request_id, load.start_block,
                                            list(load.block_ids), load.digest))
            return
        for load in metadata.loads:
            if not load.block_ids:
                client.release(load.address, load.remote_request_id, load.digest)
                continue
            try:
                client.pull(load.address, load.remote_request_id, load.start_block,
                            load.block_ids, load.digest)
            except KVTransferError as exc:
                self._failed_sync += 1
                logger.warning("pulling the KV of request %s from %s failed (%s); it is "
                               "recomputed here", load.request_id, load.address, exc)
                self._invalid.update(load.block_ids)

    def wait_for_save(self) -> None:
        step, self._step = self._step, None
        if step is not None and self._server is not None:
            self._server.mark_ready([s.request_id for s in step.sends if s.ready])

    def get_finished(self, finished_req_ids: list[str]) -> tuple[set[str], set[str]]:
        sending = self._server.take_finished() if self._server is not None else set()
        recving: set[str] = set()
        if self._puller is not None:
            self._puller.cancel(finished_req_ids)
            recving, invalid = self._puller.take_finished()
            if invalid:
                # (Reported with their requests, this same step: the scheduler recomputes them.)
                self._invalid.update(invalid)
        return sending, recving

    @property
    def failed_loads(self) -> int:
        """Pulls that failed (each recomputed), synchronous and background ones."""
        return self._failed_sync + (self._puller.failed if self._puller is not None else 0)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def shutdown(self) -> None:
        if self._puller is not None:
            if not self._puller.close():
                self._client = None  # its sockets belong to the stuck pull thread
            self._puller = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._client is not None:
            self._client.close()
            self._client = None
