"""The P2pConnector between two in-process engines (a prefill producer and a decode consumer on
one host, tiny random model): the consumer loads the producer's prompt blocks instead of
computing them and gives the same greedy tokens as one engine; a producer that is gone or a
prompt that differs means a recompute, never a wrong answer; the producer holds a finished
request's blocks until they are pulled."""

from __future__ import annotations

import logging
import random
import socket
import threading
import time

import msgspec
import pytest
import torch
import zmq

from tidal.engine_core.config import ConfigError, EngineArgs
from tidal.engine_core.core import EngineCore
from tidal.engine_core.kv_transfer.p2p_connector import (
    KVTransferParamsError,
    check_producer_allowed,
    prompt_digest,
)
from tidal.engine_core.kv_transfer.p2p_transport import KVChunk, KVPull, block_axis
from tidal.engine_core.protocol import EngineCoreRequest, FinishReason
from tidal.engine_core.request import Request
from tidal.engine_core.sampling_params import SamplingParams

BS = 16  # block size (EngineArgs' default)
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PREFILL = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_core(folder, role: str | None = None, port: int = 0, engine: dict | None = None,
              **extra) -> EngineCore:
    kv = None
    if role is not None:
        kv = {"kv_connector": "P2pConnector", "kv_role": role, "kv_port": port or _free_port(),
              "kv_connector_extra_config": {"pull_timeout_s": 1.0, **extra}}
    args = EngineArgs(model=str(folder), max_model_len=256, num_kv_blocks=32,
                      enable_prefix_caching=True, kv_transfer_config=kv, **(engine or {}))
    return EngineCore(args.create_config())


def run(core: EngineCore, reqs: list[EngineCoreRequest], stats: list | None = None):
    """Every request to the end: (tokens, finishing output) per request id."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    last = {}
    for r in reqs:
        core.add_request(r)
    while core.has_unfinished_requests():
        step = core.step()
        core.scheduler.kv.check_invariants()
        if stats is not None:
            stats.append(step.scheduler_stats)
        for o in step.outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                last[o.request_id] = o
    return tokens, last


def total(stats: list, field: str) -> int:
    return sum(getattr(s, field) for s in stats)


def worker_connector(core: EngineCore):
    return core.executor.worker.runner.kv_hooks.connector


@pytest.fixture(scope="module")
def engines(tiny_models):
    folder, hf = tiny_models["llama"]
    producer = make_core(folder, "kv_producer")
    consumer = make_core(folder, "kv_consumer")
    # The reference, one engine computing each prompt whole: the consumer itself, under a
    # cache salt per request (no prefix hits) and without kv_transfer_params.
    yield folder, hf.config.vocab_size, producer, consumer, consumer
    for core in (producer, consumer):
        core.shutdown()


@pytest.fixture(scope="module")
def gloo_consumer(engines):
    """A consumer pulling over a two-rank gloo pair (async pulls, the default)."""
    core = make_core(engines[0], "kv_consumer", transport="gloo")
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def sync_consumer(engines):
    """A consumer pulling inside the step that first schedules the request."""
    core = make_core(engines[0], "kv_consumer", async_pull=False)
    yield core
    core.shutdown()


def reference_run(core: EngineCore, reqs: list[EngineCoreRequest]):
    for r in reqs:
        r.cache_salt = f"reference-{r.request_id}"
    return run(core, reqs)


def _released(producer: EngineCore) -> bool:
    """Poll the producer (its workers report finished sends) until it holds no blocks for a
    consumer; the consumer's last message reaches the producer's server asynchronously."""
    deadline = time.monotonic() + 5
    while producer.scheduler.has_held_kv and time.monotonic() < deadline:
        producer.poll_kv_transfers(force=True)
        time.sleep(0.005)
    return not producer.scheduler.has_held_kv


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _prefill(producer: EngineCore, rid: str, prompt: list[int]) -> dict:
    _, last = run(producer, [EngineCoreRequest(rid, prompt, PREFILL,
                                               kv_transfer_params={"do_remote_decode": True})])
    params = last[rid].kv_transfer_params
    assert params is not None and params["do_remote_prefill"] is True
    return params


@pytest.mark.parametrize("n", [70, 33, 16])
def test_decode_loads_the_prefill_kv_and_matches_one_engine(engines, n):
    _, vocab, producer, consumer, reference = engines
    prompt = _prompt(vocab, n, seed=n)
    expected, _ = reference_run(reference, [EngineCoreRequest(f"ref{n}", prompt, GREEDY)])
    params = _prefill(producer, f"p{n}", prompt)
    assert params["remote_request_id"] == f"p{n}" and params["remote_num_tokens"] == n
    # Blocks kept for the consumer, if it has any whole block to load.
    assert (f"p{n}" in producer.scheduler._kv_held) == ((n - 1) // BS > 0)
    stats: list = []
    got, last = run(consumer, [EngineCoreRequest(f"d{n}", prompt, GREEDY,
                                                 kv_transfer_params=params)], stats)
    assert got[f"d{n}"] == expected[f"ref{n}"]
    loaded = (n - 1) // BS * BS  # whole blocks, one prompt token left to compute
    assert total(stats, "kv_connector_hits") == loaded
    # The consumer really skipped those prompt tokens (and reports them as cached).
    assert total(stats, "num_prompt_tokens") == n - loaded
    assert last[f"d{n}"].num_cached_tokens == loaded
    # The pull released the producer's blocks (the next poll frees them).
    assert _released(producer)
    assert producer.scheduler.kv.usage == 0.0


def test_failed_pull_recomputes(engines):
    folder, vocab, producer, consumer, reference = engines
    prompt = _prompt(vocab, 50, seed=1)
    expected, _ = reference_run(reference, [EngineCoreRequest("ref", prompt, GREEDY)])
    params = _prefill(producer, "gone", prompt)
    # Params naming a request the producer no longer has (as after a restart): the consumer's
    # background pull is refused, the request never runs on the unfilled blocks and computes
    # its whole prompt.
    failed_before = worker_connector(consumer).failed_loads
    stats: list = []
    lost = dict(params, remote_request_id="lost")
    got, last = run(consumer, [EngineCoreRequest("d-gone", prompt, GREEDY,
                                                 kv_transfer_params=lost)], stats)
    assert got["d-gone"] == expected["ref"]
    assert worker_connector(consumer).failed_loads == failed_before + 1
    assert total(stats, "num_prompt_tokens") == 50
    assert last["d-gone"].num_cached_tokens == 0
    # A producer that is not there at all (nothing listens): a timeout, then the same.
    dead = dict(params, remote_port=_free_port(), remote_request_id="x")
    got, _ = run(consumer, [EngineCoreRequest("d-dead", prompt, GREEDY, cache_salt="dead",
                                              kv_transfer_params=dead)])
    assert got["d-dead"] == expected["ref"]
    assert worker_connector(consumer).failed_loads == failed_before + 2
    # The genuine consumer, with a local hit on every whole block by now, pulls nothing but
    # still releases the producer's blocks.
    got, _ = run(consumer, [EngineCoreRequest("d-late", prompt, GREEDY,
                                              kv_transfer_params=params)])
    assert got["d-late"] == expected["ref"]
    assert _released(producer)


def test_producer_dying_mid_transfer_means_a_recompute(engines):
    """A producer that sends the first layer (garbage, into the consumer's blocks) and then goes
    silent, as one killed between two chunks: the consumer times out, drops the step that ran
    on half-written blocks, takes them out of its prefix cache (or its own re-admission would
    hit them), and recomputes."""
    _, vocab, _, consumer, reference = engines
    prompt = _prompt(vocab, 60, seed=6)
    expected, _ = reference_run(reference, [EngineCoreRequest("ref", prompt, GREEDY)])
    caches = worker_connector(consumer)._client.kv_caches
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    pulls: list[KVPull] = []

    def half_a_producer() -> None:
        if not sock.poll(10_000):
            return
        peer, body = sock.recv_multipart()
        pull = msgspec.msgpack.decode(body, type=KVPull)
        pulls.append(pull)
        shape = list(caches[0].shape)
        shape[block_axis(caches[0])] = pull.end_block - pull.start_block
        garbage = torch.full(shape, 7.0, dtype=caches[0].dtype)
        head = KVChunk(pull.request_id, 0, 0, 1, len(caches),
                       str(caches[0].dtype).removeprefix("torch."), [shape])
        sock.send_multipart([peer, msgspec.msgpack.encode(head),
                             garbage.view(torch.uint8).numpy().tobytes()])
        # ... and never answers the next chunk.

    thread = threading.Thread(target=half_a_producer, daemon=True)
    thread.start()
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port,
              "remote_request_id": "p-dying", "remote_num_tokens": 60,
              "remote_digest": prompt_digest(Request("x", prompt, GREEDY, 1, frozenset()))}
    failed_before = worker_connector(consumer).failed_loads
    stats: list = []
    try:
        got, last = run(consumer, [EngineCoreRequest("d-dying", prompt, GREEDY,
                                                     cache_salt="dying",
                                                     kv_transfer_params=params)], stats)
    finally:
        thread.join(5)
        sock.close(0)
        ctx.term()
    assert [p.chunk for p in pulls] == [0]  # it did start
    assert worker_connector(consumer).failed_loads == failed_before + 1
    assert got["d-dying"] == expected["ref"]
    assert last["d-dying"].num_cached_tokens == 0
    # What the prefix cache holds for that prompt now is the recomputed KV.
    again, _ = run(consumer, [EngineCoreRequest("d-again", prompt, GREEDY, cache_salt="dying")])
    assert again["d-again"] == expected["ref"]


def test_producer_addresses_are_loopback_or_allowed():
    def params(host: str, port: int = 7000) -> dict:
        return {"do_remote_prefill": True, "remote_host": host, "remote_port": port}

    for host in ("127.0.0.1", "127.8.9.1", "::1", "localhost"):
        check_producer_allowed(params(host), [])
    for host in ("10.0.0.5", "0.0.0.0", "169.254.169.254", "example.com", "::ffff:10.0.0.5"):
        with pytest.raises(KVTransferParamsError, match="remote_host.*allowed_producers"):
            check_producer_allowed(params(host), [])
    check_producer_allowed(params("10.0.0.5"), ["10.0.0.5:7000"])
    with pytest.raises(KVTransferParamsError, match="not an allowed producer"):
        check_producer_allowed(params("10.0.0.5", 7001), ["10.0.0.5:7000"])
    check_producer_allowed(params("10.0.0.5", 7001), ["10.0.0.5"])  # a host: any port
    check_producer_allowed({"do_remote_decode": True}, [])  # nothing to connect to


def test_the_engine_refuses_a_producer_it_may_not_connect_to(engines, monkeypatch):
    """Past the API's check (a client of the engine directly): no connection is even tried;
    the prompt is computed here."""
    from tidal.engine_core.kv_transfer import p2p_transport

    _, vocab, _, consumer, reference = engines
    prompt = _prompt(vocab, 40, seed=9)
    expected, _ = reference_run(reference, [EngineCoreRequest("ref-far", prompt, GREEDY)])
    tried: list = []
    monkeypatch.setattr(p2p_transport.KVPullClient, "pull",
                        lambda self, *a, **k: tried.append(a))
    params = {"do_remote_prefill": True, "remote_host": "10.1.2.3", "remote_port": 9,
              "remote_request_id": "far", "remote_num_tokens": 40,
              "remote_digest": prompt_digest(Request("x", prompt, GREEDY, 1, frozenset()))}
    stats: list = []
    got, _ = run(consumer, [EngineCoreRequest("d-far", prompt, GREEDY, cache_salt="far",
                                              kv_transfer_params=params)], stats)
    assert got["d-far"] == expected["ref-far"]
    assert tried == [] and total(stats, "kv_connector_hits") == 0


def test_params_of_another_prompt_are_not_loaded(engines):
    _, vocab, producer, consumer, reference = engines
    prompt = _prompt(vocab, 40, seed=2)
    other = _prompt(vocab, 40, seed=3)
    expected, _ = reference_run(reference, [EngineCoreRequest("ref", other, GREEDY)])
    params = _prefill(producer, "p-other", prompt)
    stats: list = []
    got, _ = run(consumer, [EngineCoreRequest("d-other", other, GREEDY,
                                              kv_transfer_params=params)], stats)
    assert got["d-other"] == expected["ref"]
    assert total(stats, "kv_connector_hits") == 0
    assert total(stats, "num_prompt_tokens") == 40
    # A forged digest is refused by the producer itself: still a recompute.
    forged = dict(params, remote_num_tokens=40)
    forged["remote_digest"] = prompt_digest(Request("x", other, GREEDY, 1, frozenset()))
    got, _ = run(consumer, [EngineCoreRequest("d-forged", other, GREEDY,
                                              kv_transfer_params=forged)])
    assert got["d-forged"] == expected["ref"]
    total_failed = worker_connector(consumer).failed_loads
    # ... and its release of the blocks too: the real consumer still pulls them afterwards.
    stats = []
    got, _ = run(consumer, [EngineCoreRequest("d-real", prompt, GREEDY, cache_salt="real",
                                              kv_transfer_params=params)], stats)
    assert worker_connector(consumer).failed_loads == total_failed
    assert total(stats, "kv_connector_hits") == 32
    assert _released(producer)


def test_aborted_prefill_holds_nothing(engines):
    _, vocab, producer, _, _ = engines
    prompt = _prompt(vocab, 40, seed=4)
    producer.add_request(EngineCoreRequest("ab", prompt, PREFILL,
                                           kv_transfer_params={"do_remote_decode": True}))
    producer.abort_requests(["ab"])
    assert not producer.scheduler.has_held_kv
    assert producer.scheduler.kv.usage == 0.0
    # A request finished by its stop (not a prefill for a remote decode) holds nothing either.
    out, last = run(producer, [EngineCoreRequest("plain", prompt, PREFILL)])
    assert last["plain"].kv_transfer_params is None
    assert last["plain"].finish_reason == FinishReason.LENGTH
    assert not producer.scheduler.has_held_kv


@pytest.mark.parametrize("extra, match", [
    ({"transport": "nccl"}, "transport 'nccl' needs a CUDA engine"),
    ({"async_pull": "yes"}, "async_pull must be true or false"),
    ({"transport": "carrier pigeon"}, "transport must be one of"),
    ({"pull_timeout_s": 0}, "pull_timeout_s must be seconds"),
    ({"colour": "blue"}, "unknown key"),
    ({"allowed_producers": "10.0.0.1:7000"}, "allowed_producers must be a list"),
    ({"allowed_producers": [7000]}, "allowed_producers must be a list"),
    ({"nccl_streams": 0}, "nccl_streams must be an integer in"),
    ({"nccl_streams": 5}, "nccl_streams must be an integer in"),
    ({"nccl_streams": True}, "nccl_streams must be an integer in"),
    ({"min_direct_bytes": 0}, "min_direct_bytes must be an integer of bytes"),
    ({"min_direct_bytes": 1.5}, "min_direct_bytes must be an integer of bytes"),
    ({"min_direct_bytes": True}, "min_direct_bytes must be an integer of bytes"),
])
def test_bad_p2p_configs_are_refused(tiny_models, extra, match):
    folder, _ = tiny_models["llama"]
    kv = {"kv_connector": "P2pConnector", "kv_role": "kv_consumer",
          "kv_connector_extra_config": extra}
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=str(folder), max_model_len=128, num_kv_blocks=8, device="cpu",
                   kv_transfer_config=kv).create_config()


def test_consumer_flags_on_a_producer_warn(tiny_models, caplog):
    """The consumer picks the transport and pulls: a CPU producer given them still starts
    (it serves every transport) and says they do nothing there."""
    folder, _ = tiny_models["llama"]
    kv = {"kv_connector": "P2pConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"transport": "nccl", "async_pull": False}}
    with caplog.at_level(logging.WARNING):
        EngineArgs(model=str(folder), max_model_len=128, num_kv_blocks=8, device="cpu",
                   kv_transfer_config=kv).create_config()
    assert "transport, async_pull has no effect on a producer" in caplog.text


@pytest.mark.parametrize("kw, match", [
    (dict(tensor_parallel_size=2, distributed_executor_backend="mp"),
     "not yet supported: P2pConnector with tensor"),
    # (The engine config refuses any connector with DP ranks before P2pConnector is asked.)
    (dict(data_parallel_size=2), "data-parallel-size > 1 with a KV connector is not yet "
                                 "supported|not yet supported: P2pConnector with data"),
])
def test_parallel_engines_are_refused(tiny_models, kw, match):
    folder, _ = tiny_models["llama"]
    kv = {"kv_connector": "P2pConnector", "kv_role": "kv_producer"}
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=str(folder), max_model_len=128, num_kv_blocks=8,
                   kv_transfer_config=kv, **kw).create_config()


def test_gloo_transport_matches_one_engine(engines, gloo_consumer):
    _, vocab, producer, _, reference = engines
    n = 70
    prompt = _prompt(vocab, n, seed=70)
    expected, _ = reference_run(reference, [EngineCoreRequest("ref-g", prompt, GREEDY)])
    params = _prefill(producer, "p-gloo", prompt)
    stats: list = []
    got, last = run(gloo_consumer, [EngineCoreRequest("d-gloo", prompt, GREEDY,
                                                      kv_transfer_params=params)], stats)
    assert got["d-gloo"] == expected["ref-g"]
    loaded = (n - 1) // BS * BS
    assert total(stats, "num_prompt_tokens") == n - loaded  # the prefill was skipped
    assert last["d-gloo"].num_cached_tokens == loaded
    client = worker_connector(gloo_consumer)._client
    assert client.backend == "gloo" and len(client._pairs) == 1  # over the pair, not frames
    assert _released(producer)


def test_sync_pull_failure_drops_the_step(engines, sync_consumer):
    """``async_pull: false``: the pull runs in the step that schedules the request; a refused
    one drops that step's output and recomputes."""
    _, vocab, producer, _, reference = engines
    prompt = _prompt(vocab, 50, seed=11)
    expected, _ = reference_run(reference, [EngineCoreRequest("ref-s", prompt, GREEDY)])
    params = _prefill(producer, "p-sync", prompt)
    stats: list = []
    got, _ = run(sync_consumer, [EngineCoreRequest("d-sync-lost", prompt, GREEDY,
                                                   kv_transfer_params=dict(
                                                       params, remote_request_id="lost"))],
                 stats)
    assert got["d-sync-lost"] == expected["ref-s"]
    assert total(stats, "num_prompt_tokens") == 2 + 50  # tried on 2 tokens, then all 50
    stats = []
    got, _ = run(sync_consumer, [EngineCoreRequest("d-sync", prompt, GREEDY,
                                                   cache_salt="sync",
                                                   kv_transfer_params=params)], stats)
    assert got["d-sync"] == expected["ref-s"]
    assert total(stats, "kv_connector_hits") == 48
    assert _released(producer)


@pytest.fixture
def slow_pulls(monkeypatch):
    """Every pull waits for the returned event first (as a slow link would)."""
    from tidal.engine_core.kv_transfer import p2p_transport

    gate = threading.Event()
    pull = p2p_transport.KVPullClient.pull

    def gated(self, *args, **kwargs):
        gate.wait(10)
        return pull(self, *args, **kwargs)

    monkeypatch.setattr(p2p_transport.KVPullClient, "pull", gated)
    yield gate
    gate.set()


def test_other_requests_decode_while_a_pull_is_slow(engines, slow_pulls):
    _, vocab, producer, consumer, reference = engines
    prompt_a, prompt_b = _prompt(vocab, 20, seed=21), _prompt(vocab, 70, seed=22)
    expected, _ = reference_run(reference, [EngineCoreRequest("ref-a", prompt_a, GREEDY),
                                            EngineCoreRequest("ref-b", prompt_b, GREEDY)])
    params = _prefill(producer, "p-slow", prompt_b)
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    consumer.add_request(EngineCoreRequest("a", prompt_a, GREEDY, cache_salt="slow"))
    consumer.add_request(EngineCoreRequest("b", prompt_b, GREEDY, kv_transfer_params=params))
    finished: dict = {}
    for _ in range(200):  # "a" runs to its end while "b"'s pull hangs
        for o in consumer.step().outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                finished[o.request_id] = o
        if "a" in finished:
            break
    assert tokens["a"] == expected["ref-a"]
    assert tokens["b"] == [] and "b" in consumer.scheduler._kv_recving
    slow_pulls.set()
    while consumer.has_unfinished_requests():
        for o in consumer.step().outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                finished[o.request_id] = o
        consumer.scheduler.kv.check_invariants()
    assert tokens["b"] == expected["ref-b"]
    assert finished["b"].num_cached_tokens == 64  # loaded, not computed
    assert _released(producer)


def test_abort_during_a_pull_holds_its_blocks_until_the_pull_ends(engines, slow_pulls):
    _, vocab, producer, consumer, _ = engines
    prompt = _prompt(vocab, 40, seed=31)
    params = _prefill(producer, "p-abort", prompt)
    consumer.add_request(EngineCoreRequest("d-abort", prompt, GREEDY, cache_salt="abort",
                                           kv_transfer_params=params))
    consumer.step()
    assert "d-abort" in consumer.scheduler._kv_recving
    consumer.abort_requests(["d-abort"])
    # The pull still writes those blocks: they stay allocated, nobody else may get them.
    assert not consumer.has_unfinished_requests() and consumer.scheduler.has_held_kv
    assert consumer.scheduler.kv.usage > 0
    slow_pulls.set()
    deadline = time.monotonic() + 10
    while consumer.scheduler.has_held_kv and time.monotonic() < deadline:
        consumer.poll_kv_transfers(force=True)
        time.sleep(0.005)
    assert not consumer.scheduler.has_held_kv
    assert consumer.scheduler.kv.usage == 0.0
    consumer.scheduler.kv.check_invariants()
    assert _released(producer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (background pulls on their own CUDA stream)")
def test_gpu_background_pull_matches_one_engine(tiny_models):
    """Both engines on one GPU (zmq transport: NCCL needs two): the consumer's pull runs on the
    pull thread's own stream, after the producer's forward (its event), and the request
    decodes on the loaded blocks as the consumer would compute them itself."""
    folder, hf = tiny_models["llama"]
    engine = {"device": "cuda", "dtype": "float32", "enforce_eager": True}
    producer = make_core(folder, "kv_producer", engine=engine, pull_timeout_s=30.0)
    consumer = make_core(folder, "kv_consumer", engine=engine, pull_timeout_s=30.0)
    try:
        for n in (70, 130):
            prompt = _prompt(hf.config.vocab_size, n, seed=100 + n)
            expected, _ = reference_run(consumer, [EngineCoreRequest(f"gref{n}", prompt,
                                                                     GREEDY)])
            params = _prefill(producer, f"gp{n}", prompt)
            stats: list = []
            got, last = run(consumer, [EngineCoreRequest(f"gd{n}", prompt, GREEDY,
                                                         kv_transfer_params=params)], stats)
            assert got[f"gd{n}"] == expected[f"gref{n}"]
            assert last[f"gd{n}"].num_cached_tokens == (n - 1) // BS * BS
            assert total(stats, "num_prompt_tokens") == n - (n - 1) // BS * BS
        assert worker_connector(consumer).failed_loads == 0
        assert _released(producer)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_the_connector_default_for_direct_runs_is_the_transport_s():
    """The connector keeps the threshold as a number (it is imported where torch is not);
    it must stay the transport's."""
    from tidal.engine_core.kv_transfer.p2p_connector import DEFAULT_MIN_DIRECT_BYTES
    from tidal.engine_core.kv_transfer.p2p_direct_runs import DIRECT_MIN_BYTES

    assert DEFAULT_MIN_DIRECT_BYTES == DIRECT_MIN_BYTES


def test_a_connector_allocated_again_pulls_into_the_new_cache(engines, gloo_consumer):
    """The worker may register its KV cache again (allocated anew): the transport's cached
    views of the old one go with it, so a direct run lands in the cache the model reads."""
    connector = worker_connector(gloo_consumer)
    client = connector._client
    old = client.kv_caches
    assert client._bytes  # (gloo on host memory: direct runs, so views are cached)
    fresh = [torch.zeros_like(c) for c in old]
    connector.register_kv_caches(fresh)
    try:
        assert client.kv_caches is fresh
        assert [b.flat.data_ptr() for b in client._bytes] == [c.data_ptr() for c in fresh]
    finally:
        connector.register_kv_caches(old)
    assert [b.flat.data_ptr() for b in client._bytes] == [c.data_ptr() for c in old]
