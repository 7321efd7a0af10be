"""The KV connector API without a model: the kv-transfer config, the registry (in-tree names and
entry-point plugins), the host tier's LRU index, the step metadata on the wire, and the
scheduler's hooks driven by a recording connector."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from tidal.engine_core import plugins
from tidal.engine_core.kv_transfer import connector_registry
from tidal.engine_core.kv_transfer.connector_base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from tidal.engine_core.kv_transfer.host_tier_index import HostTierIndex
from tidal.engine_core.kv_transfer.offloading_connector import OffloadingConnector, OffloadMeta
from tidal.engine_core.kv_transfer_config import (
    KVTransferConfig,
    KVTransferConfigError,
    build_kv_transfer_config,
)
from tidal.engine_core.protocol import ModelRunnerOutput, SchedulerOutput

# --- config ------------------------------------------------------------------------------------


def test_json_config_reads_vllm_field_names():
    c = build_kv_transfer_config(
        '{"kv_connector": "P2pConnector", "kv_role": "kv_producer", "kv_buffer_size": 1e8, '
        '"kv_port": 21001, "kv_connector_extra_config": {"send_type": "PUT"}}', None)
    assert c == KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_producer",
                                 kv_buffer_size=1e8, kv_port=21001,
                                 kv_connector_extra_config={"send_type": "PUT"})
    assert c.is_producer and not c.is_consumer and c.extra("send_type") == "PUT"
    assert build_kv_transfer_config(None, None) is None


def test_offload_gb_is_offloading_connector_shorthand():
    c = build_kv_transfer_config(None, 2.5)
    assert c.kv_connector == "OffloadingConnector" and c.kv_buffer_size == 2.5e9


@pytest.mark.parametrize("raw, match", [
    ("{not json", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ({"kv_role": "kv_both"}, "kv_connector is required"),
    ({"kv_connector": "X", "kv_rol": "kv_both"}, "unknown field.*kv_rol"),
    ({"kv_connector": "X", "kv_role": "kv_sender"}, "kv_role must be one of"),
    ({"kv_connector": "X", "kv_port": 70000}, "kv_port"),
    ({"kv_connector": "X", "kv_buffer_size": -1}, "kv_buffer_size"),
    ({"kv_connector": "X", "kv_buffer_size": "big"}, "kv_buffer_size"),
    ({"kv_connector": "X", "kv_ip": "example.com"}, "kv_ip"),
    ({"kv_connector": "X", "kv_buffer_device": "tpu"}, "kv_buffer_device"),
    ({"kv_connector": " "}, "must name a connector"),
])
def test_bad_json_config_names_the_field(raw, match):
    with pytest.raises(KVTransferConfigError, match=match):
        build_kv_transfer_config(raw, None)


def test_cli_flags_parse():
    from tidal.engine_core.cli import build_parser, engine_args_from

    ns = build_parser().parse_args(["--kv-offload-gb", "1.5", "--kv-transfer-config",
                                    '{"kv_connector": "OffloadingConnector"}'])
    args = engine_args_from(ns)
    assert args.kv_offload_gb == 1.5
    assert args.kv_transfer_config == {"kv_connector": "OffloadingConnector"}


# --- registry ------------------------------------------------------------------------------------


class RecordingConnector(KVConnectorBase):
    """Matches one block of every request past the local hit and records every hook."""

    calls: list = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("match", request.request_id, num_computed_tokens))
        return (self.block_size if request.num_tokens - num_computed_tokens > self.block_size
                else 0), False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append(("alloc", request.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        self.calls.append(("meta", scheduler_output.step_id))
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id))
        return True, {"remote_block_ids": list(block_ids)}


def test_registry_knows_the_in_tree_connectors():
    assert connector_registry.connector_class("OffloadingConnector") is OffloadingConnector
    assert "P2pConnector" in connector_registry.builtin_names()
    with pytest.raises(connector_registry.KVConnectorError, match="not a known KV connector"):
        connector_registry.connector_class("Nope")


def test_plugins_register_connectors_by_entry_point(monkeypatch):
    loaded = {"Recording": RecordingConnector, "Bad": dict}
    monkeypatch.setattr(plugins, "plugin_names",
                        lambda group: sorted(loaded) if group == "tidal.kv_connectors" else [])
    monkeypatch.setattr(plugins, "load_plugin", lambda group, name: loaded[name])
    assert connector_registry.connector_class("Recording") is RecordingConnector
    assert "Recording" in connector_registry.connector_names()
    with pytest.raises(connector_registry.KVConnectorError, match="not a KVConnectorBase"):
        connector_registry.connector_class("Bad")


# --- the host tier's index ---------------------------------------------------------------------


def test_host_index_is_an_lru_that_skips_pinned_slots():
    index = HostTierIndex(3)
    assert [index.store(h) for h in (b"a", b"b", b"c")] == [0, 1, 2]  # consecutive slots
    assert index.store(b"a") is None  # present: only refreshed (now most recent)
    assert index.store(b"d") == 1  # "b" was least recently used
    assert b"b" not in index and index.lookup(b"d") == 1
    assert index.take(b"c") == 2  # a load this step: pinned
    assert index.store(b"e") == 0  # LRU order is c, a, d -> c pinned, so "a" goes
    assert index.store(b"f") == 1  # then "d"
    index.check_invariants()
    # Every slot pinned: nothing is stored rather than a slot being overwritten under a load.
    for h in (b"c", b"e", b"f"):
        index.take(h)
    assert index.store(b"g") is None
    index.end_step()
    assert index.store(b"g") == 2  # "c" is least recent again, unpinned now
    index.clear()
    assert len(index) == 0 and index.store(b"x") == 0
    index.check_invariants()


def test_a_block_dropped_after_a_failed_load_never_reaches_the_host_tier():
    """Reuse evicts through ``on_evict`` (the host tier keeps a copy); a block whose load
    failed holds garbage and leaves the prefix cache without it."""
    from tidal.engine_core.block_pool import BlockPool

    pool = BlockPool(4, enable_caching=True)
    evicted: list = []
    pool.on_evict = lambda block_id, block_hash: evicted.append((block_id, block_hash))
    a, b = pool.allocate(2)
    pool.cache_block(a, b"good")
    pool.cache_block(b, b"garbage")
    pool.drop_cached(b.block_id)
    assert pool.lookup(b"garbage") is None and evicted == []
    pool.free([a, b])
    pool.allocate(4)  # reuses every block: "good" is evicted the ordinary way
    assert evicted == [(a.block_id, b"good")]
    pool.check_invariants()


# --- wire ----------------------------------------------------------------------------------------


def test_metadata_and_finished_ids_cross_the_wire_without_pickle():
    meta = OffloadMeta(store_block_ids=[4, 5], store_slots=[0, 1], load_block_ids=[7],
                       load_slots=[3])
    so = SchedulerOutput(step_id=3, kv_connector_metadata=msgspec.msgpack.encode(meta))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(so), type=SchedulerOutput)
    assert msgspec.msgpack.decode(back.kv_connector_metadata, type=OffloadMeta) == meta
    out = ModelRunnerOutput(kv_finished_sending=["a"], kv_finished_recving=["b"])
    back_out = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=ModelRunnerOutput)
    assert (back_out.kv_finished_sending, back_out.kv_finished_recving) == (["a"], ["b"])
    # Without a connector nothing extra travels.
    assert msgspec.msgpack.encode(SchedulerOutput(step_id=3)) == \
        msgspec.msgpack.encode(SchedulerOutput(step_id=3, kv_connector_metadata=b""))


# --- scheduler hooks, with a recording connector -------------------------------------------------


@pytest.fixture
def recording_scheduler(tiny_models, monkeypatch):
    from tidal.engine_core.config import EngineArgs
    from tidal.engine_core.scheduler import Scheduler

    real = connector_registry.connector_class
    monkeypatch.setattr(connector_registry, "connector_class",
                        lambda name: RecordingConnector if name == "Recording" else real(name))
    RecordingConnector.calls = []
    folder, _ = tiny_models["llama"]
    config = EngineArgs(model=str(folder), max_model_len=128, num_kv_blocks=16,
                        kv_transfer_config={"kv_connector": "Recording"}).create_config()
    return Scheduler(config)


def test_scheduler_calls_the_hooks_at_their_points(recording_scheduler):
    from tidal.engine_core.protocol import EngineCoreRequest, FinishReason
    from tidal.engine_core.request import Request
    from tidal.engine_core.sampling_params import SamplingParams

    sched = recording_scheduler
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    sched.add_request(Request.from_engine_request(
        EngineCoreRequest("r", list(range(3, 43)), params), 128, frozenset()))
    out = sched.schedule()
    calls = RecordingConnector.calls
    assert calls[0] == ("match", "r", 0)
    assert calls[1][0] == "alloc" and calls[1][3] == 16 and len(calls[1][2]) == 3
    assert calls[2] == ("meta", out.step_id)
    # The external block counts as computed: only the other 24 prompt tokens are scheduled.
    assert out.num_scheduled_tokens == [24]
    assert out.new_reqs[0].num_computed_tokens == 16
    # An empty step message with nothing held stays b"": the workers make no connector call.
    assert out.kv_connector_metadata == b""
    # Finished with delay_free: the blocks stay held until a worker reports the send done.
    free_before = sched.kv.num_free_blocks
    sched.finish_requests(["r"], FinishReason.ABORT)
    assert ("finished", "r") in calls
    assert sched.kv.num_free_blocks == free_before and sched.has_held_kv
    # While blocks are held, even an empty message goes out (the workers report sends then).
    poll = sched.kv_poll_output()
    assert poll is not None and poll.kv_connector_metadata == msgspec.msgpack.encode(
        KVConnectorMetadata())
    sched.update_from_output(SchedulerOutput(step_id=99),
                             ModelRunnerOutput(kv_finished_sending=["r"]))
    assert sched.kv.num_free_blocks == 16 and not sched.has_held_kv


def test_a_send_reported_before_its_request_finished_holds_nothing(recording_scheduler):
    """Async scheduling with a send timeout under one step: the workers' ``finished_sending``
    for a request can arrive before the output that finishes it; its blocks must not be held
    for a send that is over."""
    from tidal.engine_core.protocol import EngineCoreRequest, FinishReason
    from tidal.engine_core.request import Request
    from tidal.engine_core.sampling_params import SamplingParams

    sched = recording_scheduler
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    sched.add_request(Request.from_engine_request(
        EngineCoreRequest("r", list(range(3, 43)), params), 128, frozenset()))
    sched.schedule()
    sched.update_from_output(SchedulerOutput(step_id=98),
                             ModelRunnerOutput(kv_finished_sending=["r", "unknown"]))
    sched.finish_requests(["r"], FinishReason.ABORT)
    assert ("finished", "r") in RecordingConnector.calls
    assert not sched.has_held_kv and sched.kv.num_free_blocks == 16
    assert not sched._kv_sent_early  # nothing left behind, "unknown" never recorded


def test_async_loads_wait_off_the_batch_then_run_or_recompute(recording_scheduler,
                                                             monkeypatch):
    """A connector answering ``load_async``: the request gets its blocks (kept out of the
    prefix cache) and waits outside the batch while others run; reported in
    ``finished_recving`` it runs from its loaded tokens; reported with its blocks invalid it
    recomputes; aborted mid-load its blocks stay held until the load is reported over."""
    from tidal.engine_core.protocol import EngineCoreRequest, FinishReason
    from tidal.engine_core.request import Request
    from tidal.engine_core.sampling_params import SamplingParams

    sched = recording_scheduler
    tried: set[str] = set()

    def match(self, request, n):  # each request is loaded once (as P2pConnector does)
        if request.request_id in tried:
            return 0, False
        tried.add(request.request_id)
        return 16, request.request_id != "sync"

    monkeypatch.setattr(RecordingConnector, "get_num_new_matched_tokens", match)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = {"a": list(range(3, 43)), "sync": list(range(50, 90)),
               "b": list(range(100, 140)), "c": list(range(200, 240))}
    for rid in ("a", "sync"):
        sched.add_request(Request.from_engine_request(
            EngineCoreRequest(rid, prompts[rid], params), 128, frozenset()))
    out = sched.schedule()
    assert [r.req_id for r in out.new_reqs] == ["sync"]  # "a" waits for its load
    assert "a" in sched._kv_recving and sched.has_held_kv and out.kv_connector_metadata
    a_blocks = sched.kv.block_ids("a")
    # The whole prompt's blocks, last token's slot included: once loaded it needs no more.
    assert len(a_blocks) == 3
    assert all(sched.kv.pool.blocks[b].block_hash is None for b in a_blocks)
    sched.update_from_output(out, ModelRunnerOutput(kv_finished_recving=["a"]))
    out = sched.schedule()
    (new,) = out.new_reqs
    assert new.req_id == "a" and new.num_computed_tokens == 16 and new.block_ids == a_blocks
    assert out.num_scheduled_tokens[-1] == 40 - 16
    # A failed load: its blocks come back invalid; it restarts from no tokens at all.
    sched.add_request(Request.from_engine_request(
        EngineCoreRequest("b", prompts["b"], params), 128, frozenset()))
    sched.schedule()
    b_blocks = sched.kv.block_ids("b")
    sched.update_from_output(SchedulerOutput(step_id=97), ModelRunnerOutput(
        kv_finished_recving=["b"], kv_invalid_block_ids=b_blocks))
    out = sched.schedule()
    (new,) = out.new_reqs
    assert new.req_id == "b" and new.num_computed_tokens == 0
    # Aborted mid-load: finished at once, its blocks held until the load is reported.
    sched.add_request(Request.from_engine_request(
        EngineCoreRequest("c", prompts["c"], params), 128, frozenset()))
    sched.schedule()
    free = sched.kv.num_free_blocks
    sched.finish_requests(["c"], FinishReason.ABORT)
    assert "c" not in sched.requests and sched.kv.num_free_blocks == free
    sched.update_from_output(SchedulerOutput(step_id=98),
                             ModelRunnerOutput(kv_finished_recving=["c"]))
    assert sched.kv.num_free_blocks == free + 3 and not sched._kv_recving
    sched.kv.pool.check_invariants()


def test_connector_roles_share_one_class():
    assert KVConnectorRole.SCHEDULER != KVConnectorRole.WORKER
    cfg = SimpleNamespace(kv_transfer=KVTransferConfig(kv_connector="X"),
                          cache=SimpleNamespace(block_size=16))
    base = KVConnectorBase(cfg, KVConnectorRole.WORKER, rank=2)
    assert (base.rank, base.block_size) == (2, 16)
    assert base.get_finished([]) == (set(), set())
    assert base.request_finished(None, []) == (False, None)
    with pytest.raises(NotImplementedError):
        base.get_num_new_matched_tokens(None, 0)


# --- reporting -----------------------------------------------------------------------------------


def test_metrics_and_stats_line_show_connector_hits_and_stores():
    from prometheus_client.parser import text_string_to_metric_families

    from tidal.engine_core.protocol import SchedulerStats
    from tidal.engine_core.stats_logger import kv_connector_line
    from tidal.frontend.output_processor import StepRecord
    from tidal.frontend.server.metrics import ServerMetrics

    later = SchedulerStats(kv_connector_queries=64, kv_connector_hits=48, kv_connector_stores=32)
    # A report that was never delivered folds in.
    later.add_counters(SchedulerStats(kv_connector_queries=16, kv_connector_stores=16))
    metrics = ServerMetrics("m", 128, "tidal", {})
    metrics.observe_step(later, StepRecord(engine_index=0))
    samples = {s.name: s.value for fam in text_string_to_metric_families(
        metrics.render().decode()) for s in fam.samples if s.name.endswith("_total")}
    assert samples["tidal:external_prefix_cache_queries_total"] == 80
    assert samples["tidal:external_prefix_cache_hits_total"] == 48
    assert samples["tidal:kv_connector_stored_tokens_total"] == 48
    assert kv_connector_line(80, 48, 48) == (
        "KV connector: external prefix cache hit rate 60.0% (48 of 80 queried tokens loaded), "
        "48 tokens stored")


# --- asynchronous loads: admission limits, reused ids, deadlines ---------------------------------


class AsyncLoadConnector(KVConnectorBase):
    """Loads every request's first two blocks asynchronously, once (as P2pConnector does)."""

    tried: set = set()
    async_load_timeout_s = None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id in self.tried or num_computed_tokens:
            return 0, False
        return 2 * self.block_size, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.tried.add(request.request_id)

    def request_finished(self, request, block_ids):
        self.tried.discard(request.request_id)
        return False, None


def _async_scheduler(tiny_models, monkeypatch, lora: bool = False, **kw):
    from tidal.engine_core.config import EngineArgs
    from tidal.engine_core.lora_config import LoRAConfig
    from tidal.engine_core.scheduler import Scheduler

    real = connector_registry.connector_class
    monkeypatch.setattr(connector_registry, "connector_class",
                        lambda name: AsyncLoadConnector if name == "AsyncLoad" else real(name))
    monkeypatch.setattr(AsyncLoadConnector, "tried", set())
    folder, _ = tiny_models["llama"]
    config = EngineArgs(model=str(folder), max_model_len=128, enable_prefix_caching=True,
                        kv_transfer_config={"kv_connector": "AsyncLoad"}, **kw).create_config()
    if lora:
        config = msgspec.structs.replace(config, lora=LoRAConfig(max_loras=1, max_cpu_loras=2))
    return Scheduler(config)


def _request(rid, first, n=33, adapter=None):
    from tidal.engine_core.lora_request import LoRARequest
    from tidal.engine_core.protocol import EngineCoreRequest
    from tidal.engine_core.request import Request
    from tidal.engine_core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    lora = None if adapter is None else LoRARequest(f"a{adapter}", adapter, f"/a{adapter}")
    return Request.from_engine_request(EngineCoreRequest(
        rid, list(range(first, first + n)), params, lora_request=lora), 128, frozenset())


def _step_all_loaded(sched):
    """One step whose workers report every pending load over and sample every request that
    reached its end."""
    out = sched.schedule()
    ids = [rid for rid in out.scheduled()
           if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens]
    sched.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, sampled_token_ids=[[7]] * len(ids),
        kv_finished_recving=sorted(sched._kv_recving)))
    return out


def test_parked_loads_cannot_fill_the_pool_for_good(tiny_models, monkeypatch):
    """Six 33-token requests loading 32 tokens each into 12 blocks: parked requests count as
    sequences and hold their whole prompt, so every one finishes (once, each parked its two
    loaded blocks and then waited forever for a third none could free)."""
    sched = _async_scheduler(tiny_models, monkeypatch, num_kv_blocks=12, max_num_seqs=4)
    for i in range(6):
        sched.add_request(_request(f"r{i}", 3 + 50 * i))
    for _ in range(40):
        if not sched.has_unfinished():
            break
        _step_all_loaded(sched)
        assert len(sched.running) + len(sched._kv_recving) <= 4
    assert not sched.has_unfinished()
    assert sched.kv.num_free_blocks == 12
    sched.kv.pool.check_invariants()


def test_parking_keeps_a_block_per_running_request(tiny_models, monkeypatch):
    sched = _async_scheduler(tiny_models, monkeypatch, num_kv_blocks=8, max_num_seqs=8)
    monkeypatch.setattr(AsyncLoadConnector, "tried", {"plain"})
    sched.add_request(_request("plain", 500, n=40))  # 3 blocks, runs
    sched.add_request(_request("p", 3))  # 3 blocks parked would leave 2 free: 1 running
    sched.add_request(_request("q", 100))  # 3 more would leave none for "plain"'s next block
    sched.schedule()
    assert list(sched._kv_recving) == ["p"] and sched.kv.num_free_blocks == 2


def test_parked_loads_hold_their_lora_slot(tiny_models, monkeypatch):
    sched = _async_scheduler(tiny_models, monkeypatch, lora=True, num_kv_blocks=32)
    sched.add_request(_request("a", 3, adapter=1))
    sched.schedule()
    assert list(sched._kv_recving) == ["a"]
    sched.add_request(_request("b", 100, adapter=2))
    out = sched.schedule()  # adapter 1's slot is taken by the parked "a": "b" waits
    assert not out.new_reqs and list(sched._kv_recving) == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b"]


def test_an_id_still_loading_or_sending_is_not_reused(tiny_models, monkeypatch):
    """An aborted request's pull still writes its blocks: a new request under its id must
    not inherit them (nor the old pull's report)."""
    from tidal.engine_core.protocol import FinishReason

    sched = _async_scheduler(tiny_models, monkeypatch, num_kv_blocks=12)
    sched.add_request(_request("r", 3))
    sched.schedule()
    sched.finish_requests(["r"], FinishReason.ABORT)
    with pytest.raises(ValueError, match="still in use"):
        sched.add_request(_request("r", 3))
    sched.update_from_output(SchedulerOutput(step_id=90),
                             ModelRunnerOutput(kv_finished_recving=["r"]))
    assert sched.kv.num_free_blocks == 12
    sched.add_request(_request("r", 3))  # the old load is over: the id is free again
    sched.schedule()
    assert list(sched._kv_recving) == ["r"]


def test_a_load_past_its_deadline_fails_its_request(tiny_models, monkeypatch):
    """A wedged pull: past the connector's deadline the request fails with an error (not
    recomputed: its blocks stay held until the workers report the pull over)."""
    from tidal.engine_core import scheduler as scheduler_mod

    monkeypatch.setattr(AsyncLoadConnector, "async_load_timeout_s", 10.0)
    sched = _async_scheduler(tiny_models, monkeypatch, num_kv_blocks=12)
    clock = [1000.0]
    monkeypatch.setattr(scheduler_mod.time, "monotonic", lambda: clock[0])
    sched.add_request(_request("r", 3))
    sched.schedule()
    clock[0] += 9.0
    sched.schedule()
    assert "r" in sched.requests and not sched.take_kv_rejected()
    clock[0] += 2.0
    sched.schedule()
    (out,) = sched.take_kv_rejected()
    assert out.request_id == "r" and out.error and "r" not in sched.requests
    assert sched.kv.num_free_blocks == 9  # held for the pull
    sched.update_from_output(SchedulerOutput(step_id=90),
                             ModelRunnerOutput(kv_finished_recving=["r"]))
    assert sched.kv.num_free_blocks == 12 and not sched._kv_deadline
