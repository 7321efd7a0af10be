"""Tensor parallelism across CPU and GPU ranks (``--tp-devices``;
worker/distributed/hier_allreduce.py).

Collectives: three spawned CPU processes join through ``init_distributed`` as a mixed tensor
group ``cuda,cuda,cpu`` whose "GPU" ranks (0 and 1) hold CPU tensors and share a gloo
``device_group`` (``gpu_backend="gloo"``): the whole four-step path runs, host side over shared
memory and over gloo. Checked against plain gloo all-reduces of the same inputs:

- two GPU ranks: bit-exact with the fixed order ``(g0 + g1) + c`` (the GPU sum, then the CPU
  rank; the zeros the second GPU rank enters change no bit), and within 1e-6 of gloo's own
  all-reduce (unit-scale inputs: only the association differs);
- one GPU rank (``cuda,cpu,cpu``): bit-exact with gloo's all-reduce;
- every rank ends with the same bytes; all-gather and broadcast (from a CPU rank and from a GPU
  rank) equal gloo's.

Engine: ``--tp-devices cpu,cpu`` forced through the mixed path (the config is monkeypatched, as
test_hetero_groups.py does: ``--tp-devices`` resolves an all-CPU list to the plain layout) gives
HF's greedy tokens, as one worker does. GPU (one H100): ``cuda,cpu`` in float32 gives the
all-GPU engine's greedy tokens, and a seeded random request's.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection

import msgspec
import pytest
import torch

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.sampling_params import SamplingParams

SPAWN = mp.get_context("spawn")
WORLD = 3
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 200, 17], [40, 41], list(range(30, 60))]


class Report(msgspec.Struct):
    rank: int
    checks: dict[str, bool]
    error: str = ""


def _inputs(n: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 131 + rank)
    return torch.randn(n, generator=g)


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _child(rank: int, conn: Connection) -> None:
    import torch.distributed as dist

    from tidal.worker.distributed.hier_allreduce import GlooHost, HierarchicalCollectives
    from tidal.worker.distributed.parallel_state import (
        ParallelGroup,
        destroy_distributed,
        init_distributed,
        serve_store,
    )

    torch.set_num_threads(1)
    checks: dict[str, bool] = {}
    try:
        store = None
        if rank == 0:
            store = serve_store("127.0.0.1")
            conn.send_bytes(msgspec.msgpack.encode(int(store.port)))
        port = msgspec.msgpack.decode(conn.recv_bytes(), type=int)
        tp, pp = init_distributed(rank=rank, tp_size=WORLD, pp_size=1, host="127.0.0.1",
                                  port=port, device=torch.device("cpu"), store=store,
                                  cpu_collectives="shm", mixed=True,
                                  tp_devices=("cuda", "cuda", "cpu"), gpu_backend="gloo")
        hier = tp.shm
        checks["wired"] = (isinstance(hier, HierarchicalCollectives) and tp.fast_all_reduce is None
                           and (tp.device_group is not None) == (rank < 2)
                           and hier.is_leader == (rank == 0))
        world = dist.group.WORLD
        gloo_host = GlooHost(tp.cpu_group, tp.ranks)
        groups = {
            "shm": tp,  # through ParallelGroup, as the layers call it
            "gloo": ParallelGroup(rank=rank, world_size=WORLD, ranks=tp.ranks, shm=(
                HierarchicalCollectives(rank, WORLD, (0, 1), tp.device_group, gloo_host))),
        }
        for host, group in groups.items():
            for n in (1, 1000, 270_001):  # (270k floats: more than one 1 MiB slot)
                mine = _inputs(n, rank, seed=n)
                g0, g1, c = (_inputs(n, r, seed=n) for r in range(WORLD))
                got = group.all_reduce(mine.clone())
                checks[f"{host}_{n}_fixed_order"] = _bits(got, (g0 + g1) + c)
                plain = mine.clone()
                dist.all_reduce(plain, group=world)
                checks[f"{host}_{n}_near_plain"] = bool((got - plain).abs().max() <= 1e-6)
                if n > 1000:  # gloo's ring nests the sum otherwise for two of its chunks
                    checks[f"{host}_{n}_order_differs"] = not _bits(plain, (g0 + g1) + c)
                same = [torch.empty_like(got) for _ in range(WORLD)]
                dist.all_gather(same, got, group=world)
                checks[f"{host}_{n}_every_rank_same"] = all(_bits(s, got) for s in same)
            x = _inputs(3 * 7, rank, seed=3).view(3, 7)
            want = torch.cat([_inputs(3 * 7, r, seed=3).view(3, 7) for r in range(WORLD)], -1)
            checks[f"{host}_all_gather"] = _bits(group.all_gather(x, dim=-1), want)
            for src in (2, 1):
                got = group.broadcast(_inputs(50, rank, seed=9), src=src)
                checks[f"{host}_broadcast_{src}"] = _bits(got, _inputs(50, src, seed=9))
        # One GPU rank: no device group; the host side sums in gloo's own order.
        for host, side in (("shm", hier.host), ("gloo", gloo_host)):
            one = HierarchicalCollectives(rank, WORLD, (0,), None, side)
            n = 4099
            mine = _inputs(n, rank, seed=1)
            plain = mine.clone()
            dist.all_reduce(plain, group=world)
            checks[f"one_gpu_{host}_bit_exact"] = _bits(one.all_reduce(mine.clone()), plain)
        tp.barrier()
        destroy_distributed(tp, pp)
        conn.send_bytes(msgspec.msgpack.encode(Report(rank, checks)))
    except Exception:  # noqa: BLE001 - reported to the test
        import traceback

        conn.send_bytes(msgspec.msgpack.encode(Report(rank, checks, traceback.format_exc())))


@pytest.mark.slow
def test_hierarchical_all_reduce_matches_plain():
    procs, conns = [], []
    for rank in range(WORLD):
        parent, child = SPAWN.Pipe()
        p = SPAWN.Process(target=_child, args=(rank, child), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
    try:
        assert conns[0].poll(120), "rank 0 did not report the store port"
        port = conns[0].recv_bytes()
        for c in conns:
            c.send_bytes(port)
        reports = []
        for c in conns:
            assert c.poll(180), "a rank did not report"
            reports.append(msgspec.msgpack.decode(c.recv_bytes(), type=Report))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for rep in reports:
        assert not rep.error, (rep.rank, rep.error)
        failed = [k for k, ok in rep.checks.items() if not ok]
        assert len(rep.checks) > 20 and not failed, (rep.rank, failed)


def _mixed_tp(config, devices):
    parallel = msgspec.structs.replace(config.parallel, tp_devices=devices)
    return msgspec.structs.replace(config, parallel=parallel)


def _greedy(llm):
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(o.outputs[0].token_ids)])
            for o in outs]


@pytest.mark.slow
def test_mixed_tensor_parallel_matches_one_worker(tiny_models, monkeypatch):
    """The mixed wiring end to end on two CPU ranks: the hierarchical group over shared
    memory, the mirrored profile forward (no num_kv_blocks), the sampled tokens taken from the
    output rank, the warm-up's common plan. The reference is HF's greedy choice at every
    position (``hf_teacher_forced``), the one a single worker is held to: one engine start
    instead of two."""
    from reference import hf_teacher_forced

    from tidal.frontend import LLM

    folder, hf = tiny_models["llama"]
    create = EngineArgs.create_config
    monkeypatch.setattr(EngineArgs, "create_config",
                        lambda self: _mixed_tp(create(self), ("cpu", "cpu")))
    llm = LLM(str(folder), tensor_parallel_size=2, distributed_executor_backend="mp",
              skip_tokenizer_init=True, max_num_seqs=3, max_num_batched_tokens=64,
              device="cpu", cpu_threads=1, kv_cache_memory_bytes=8 << 20)
    try:
        assert llm.config.parallel.tp_devices == ("cpu", "cpu")
        assert llm.config.parallel.cpu_collectives == "shm"
        got = _greedy(llm)
    finally:
        llm.shutdown()
    for prompt, (tokens, logprobs) in zip(PROMPTS, got):
        choices, ref = hf_teacher_forced(hf, prompt, tokens)
        assert tokens == choices
        assert max(abs(x - y) for x, y in zip(logprobs, ref)) < 1e-4


@pytest.mark.gpu
def test_gpu_rank_and_cpu_rank_match_gpu_alone(tiny_models):
    """One GPU: tensor rank 0 on the GPU, rank 1 a CPU process, float32 both, no forced KV
    size (the GPU rank's profile forward pairs with the CPU rank's); greedy tokens equal the
    all-GPU engine's, and so do a seeded random request's: the output rank (the GPU) samples
    as the all-GPU engine does, and the CPU rank must take its tokens, not its own draws."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the CPU tests above run the mixed path on the CPU)")
    from tidal.frontend import LLM

    folder, _ = tiny_models["llama"]
    args = dict(skip_tokenizer_init=True, max_num_seqs=3, dtype="float32",
                gpu_memory_utilization=0.3, max_num_batched_tokens=256)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)

    def run(llm):
        try:
            sampled = llm.generate([PROMPTS[0], PROMPTS[3]], seeded, use_tqdm=False)
            return _greedy(llm), [o.outputs[0].token_ids for o in sampled]
        finally:
            llm.shutdown()

    want, want_sampled = run(LLM(str(folder), device="cuda", enforce_eager=True, **args))
    llm = LLM(str(folder), tensor_parallel_size=2, tp_devices="cuda,cpu", **args)
    assert llm.config.parallel.tp_devices == ("cuda", "cpu")
    assert llm.config.runner.enforce_eager and llm.config.parallel.cpu_collectives == "shm"
    got, got_sampled = run(llm)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3
    assert got_sampled == want_sampled
