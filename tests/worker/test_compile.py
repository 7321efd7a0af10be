"""torch.compile of the model (``--compilation-config`` mode 3, ``tidal.worker.compilation``)
on a CPU, with Inductor's C++ backend: greedy tokens and logprobs equal the eager model's
through the real engine (chunked prefill, prefix-cache hits, async scheduling, batches of every
size), the forward is traced once, as one graph, for every decoder family of CI, and the
compile cache loads a second start's pieces without Inductor, rebuilds a corrupt one, and
misses on a changed key. The GPU case (Triton pieces, CUDA attention between them) is the one
``gpu`` test at the end.

One compiled engine serves the module (Inductor on two cores takes seconds per piece, more
with an empty Inductor cache): the tiny Qwen3 cut to one layer, so two pieces (embedding to
the attention: norm, q/k/v, q/k-norm, rotary; then o_proj, add + norm, the MLP, add + the
final norm)."""

from __future__ import annotations

import re

import pytest
import torch

from tidal.engine_core.config import EngineArgs
from tidal.frontend import LLM, SamplingParams
from tidal.worker.compilation.compile_cache import CompileCache, cache_key, key_parts
from tidal.worker.compilation.piecewise_backend import CompileStats
from tidal.worker.worker import Worker

# Three layers: the middle one's piece (layer 0's MLP + layer 1's attention inputs) reads the
# same as the next one's, so four pieces are three artifacts (piecewise_backend.piece_key).
LAYERS = {"num_hidden_layers": 3}
PROMPTS = [list(range(3, 40)), [5, 9, 2, 7, 1], [11] * 17]
# Shares PROMPTS[0]'s first two blocks: its prefill starts from the prefix cache.
PREFIX_PROMPT = list(range(3, 40)) + [8, 6, 4]


def _params() -> list[SamplingParams]:
    # Different lengths: decode batches of 3, 2 and 1 requests.
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
            for n in (5, 8, 11)]


def _llm(folder, **kw) -> LLM:
    # A 16-token budget chunks the 37-token prompt: mixed prefill + decode steps.
    return LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=128,
               max_num_seqs=4, max_num_batched_tokens=16, dtype="float32", cpu_threads=1,
               async_scheduling=True, hf_overrides=LAYERS, **kw)


def _generate(llm: LLM) -> list[tuple[list[int], list[float], int]]:
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    outs += llm.generate([PREFIX_PROMPT], _params()[:1], use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), [c.logprobs[i][t].logprob
                                        for i, t in enumerate(c.token_ids)],
                    o.num_cached_tokens))
    return res


def _runner(llm: LLM):
    return llm.engine.core.executor.worker.runner


def _assert_same(got, want) -> None:
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, lp_got, _), (_, lp_want, _) in zip(got, want):
        assert max(abs(a - b) for a, b in zip(lp_got, lp_want)) < 1e-4


@pytest.fixture(scope="module")
def qwen3(tiny_models):
    return tiny_models["qwen3"][0]


@pytest.fixture(scope="module")
def eager_out(qwen3):
    llm = _llm(qwen3)
    try:
        return _generate(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="module")
def compiled(qwen3, cache_dir):
    llm = _llm(qwen3, compilation_config={"mode": 3, "cache_dir": str(cache_dir)})
    yield llm
    llm.shutdown()


def test_compiled_tokens_match_eager_with_one_trace(compiled, eager_out):
    got = _generate(compiled)
    _assert_same(got, eager_out)
    assert got[-1][2] >= 32, "the last prompt should have hit the prefix cache"
    stats = _runner(compiled).compiled.stats
    # Dynamo and Inductor were imported on a side thread while the model loaded, joined
    # before the compile phase.
    worker = compiled.engine.core.executor.worker
    assert worker._compiler_import is None and "compiler imports" in worker.startup.phases
    # One trace served every step: the start-up's, prefill chunks, mixed steps, decode
    # batches of 3, 2 and 1, a prefix hit (async scheduling on throughout).
    assert stats.dynamo_traces == 1
    assert (stats.pieces, stats.attention_calls) == (4, 3)
    assert stats.inductor_compiles + stats.cache_hits + stats.shared == stats.pieces
    assert stats.shared == 1, "the two middle pieces should share one compiled artifact"


def test_second_start_loads_the_cache_and_rebuilds_a_corrupt_piece(compiled, qwen3, cache_dir,
                                                                   eager_out):
    first = _runner(compiled).compiled
    assert first.stats.inductor_compiles == 3 and first.stats.cache_hits == 0
    files = first.cache.piece_files()
    assert len(files) == 3  # (one file for the two middle pieces)
    victim = files[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, another hash
    victim.write_bytes(bytes(data))
    llm = _llm(qwen3, compilation_config={"mode": 3, "cache_dir": str(cache_dir)})
    try:
        second = _runner(llm).compiled
        assert second.cache.dir == first.cache.dir  # the same key
        stats = second.stats
        assert (stats.cache_hits, stats.cache_rebuilt, stats.inductor_compiles) == (2, 1, 1)
        assert stats.shared == 1
        assert stats.dynamo_traces == 1
        _assert_same(_generate(llm), eager_out)
        assert second.stats.dynamo_traces == 1
    finally:
        llm.shutdown()
    # The rebuilt piece was saved over the corrupt one: a third open finds both good.
    again = CompileCache(cache_dir, first.cache.key, first.cache.parts)
    assert again.piece_files() == files
    check = CompileStats()
    assert all(again.load(f.stem, check) is not None for f in files)
    assert check.cache_rebuilt == 0


def test_a_warm_start_runs_no_dynamo_trace(compiled, qwen3, cache_dir, eager_out):
    """A start on an intact cache entry rebuilds the compiled forward from the entry's plan
    (warm_start): no Dynamo trace, no Inductor, the same tokens and logprobs as eager."""
    from torch._dynamo.utils import counters

    assert (_runner(compiled).compiled.cache.dir / "warm.json").exists()
    counters.clear()
    llm = _llm(qwen3, compilation_config={"mode": 3, "cache_dir": str(cache_dir)})
    try:
        warm = _runner(llm).compiled
        assert warm.stats.warm_start and warm.stats.dynamo_traces == 0
        assert (warm.stats.cache_hits, warm.stats.shared, warm.stats.inductor_compiles) \
            == (3, 1, 0)
        assert (warm.stats.pieces, warm.stats.attention_calls) == (4, 3)
        assert "without a Dynamo trace" in warm.describe()
        _assert_same(_generate(llm), eager_out)
        assert warm.stats.dynamo_traces == 0 and not counters["stats"]["unique_graphs"]
        # A source file Dynamo traced that changed since (a checkout, no version bump)
        # makes the plan stale: the start traces again instead.
        import msgspec

        from tidal.worker.compilation import warm_start

        plan = warm_start.decode((warm.cache.dir / "warm.json").read_bytes())
        assert any(path.endswith("models/decoder.py") for path, _ in plan.sources)
        stale = msgspec.structs.replace(
            plan, sources=((plan.sources[0][0], "0" * 64),) + plan.sources[1:])
        assert warm_start.build(stale, warm.model, lambda key: pytest.fail(key),
                                lambda *a: pytest.fail("built")) is None
        # So does a weight or buffer of another shape than traced (a longer max_model_len
        # grows the rotary cache, not the cache key).
        assert plan.args[0].kind == "attr" and plan.args[0].layout
        moved = msgspec.structs.replace(plan, args=(
            msgspec.structs.replace(plan.args[0], layout="(1,)(1,)torch.float32"),
            *plan.args[1:]))
        assert warm_start.build(moved, warm.model, lambda key: pytest.fail(key),
                                lambda *a: pytest.fail("built")) is None
    finally:
        llm.shutdown()


def _compile_from(runner, cache_root, agree=None):
    """A second CompiledForward of the runner's model over the cache under ``cache_root``,
    compiled with the runner's start-up dummy step (``ModelRunner.compile_model``)."""
    import msgspec

    from tidal.worker.compilation.compiled_model import CompiledForward

    cc = msgspec.structs.replace(runner.config.runner.compilation, cache_dir=str(cache_root))
    forward = CompiledForward(runner.model, cc, key_inputs=dict(
        arch=runner.arch, dtype=str(runner.dtype), parallel=runner.config.parallel,
        policy=runner.kernel_policy, device=runner.device.type), agree=agree)
    n = 8
    meta = runner._dummy_meta(n, 1)
    meta.slot_mapping = torch.full((n,), -1, dtype=torch.int64)
    ids, pos = runner.bufs.input_ids[:n], runner.bufs.positions[:n]
    ids.zero_()
    pos.copy_(torch.arange(n))
    with torch.inference_mode():
        assert forward.compile(ids, pos, meta)
    return forward


def test_ranks_that_do_not_all_have_a_plan_trace(compiled, cache_dir):
    """Tensor-parallel ranks agree before warm-starting and before a plan's check forward
    (each runs collectives): here the other ranks say no both times, so this rank, whose
    entry holds a good plan, traces and runs no check forward either."""
    asked = []

    def others_say_no(ok: bool) -> bool:
        asked.append(ok)
        return False

    forward = _compile_from(_runner(compiled), cache_dir, agree=others_say_no)
    assert not forward.stats.warm_start and forward.stats.dynamo_traces == 1
    assert forward.stats.cache_hits == 3  # (counted once: the unused plan's loads are not)
    assert asked == [True, True]  # a usable plan here; a plan this rank could check


def test_a_plan_others_may_write_is_traced_instead(compiled, tmp_path, caplog):
    """The warm-start plan is code the engine runs: from an entry folder or file that the
    group or others may write (a cache under /tmp) it is refused, and the start traces."""
    import shutil

    runner = _runner(compiled)
    entry = runner.compiled.cache.dir
    for what in ("file", "folder"):
        root = tmp_path / what
        copy = root / entry.name
        shutil.copytree(entry, copy)
        assert (copy.stat().st_mode & 0o022) == 0 and (copy / "warm.json").exists()
        (copy / "warm.json" if what == "file" else copy).chmod(
            (copy / "warm.json" if what == "file" else copy).stat().st_mode | 0o020)
        caplog.clear()
        forward = _compile_from(runner, root)
        assert forward.cache.dir == copy
        assert not forward.stats.warm_start and forward.stats.dynamo_traces == 1
        assert "may be written by its group or others" in caplog.text
    # The same entry, writable by this user only, starts warm.
    good = tmp_path / "good"
    shutil.copytree(entry, good / entry.name)
    forward = _compile_from(runner, good)
    assert forward.stats.warm_start and forward.stats.dynamo_traces == 0


def test_a_changed_key_misses(compiled, cache_dir):
    cache = _runner(compiled).compiled.cache
    parts = dict(cache.parts)
    assert cache_key(parts) == cache.key
    for name, value in (("dtype", "torch.bfloat16"), ("torch", "0.0.0"), ("rank", "1"),
                        ("kernel_policy", parts["kernel_policy"] + " "),
                        ("arch", parts["arch"].replace("64", "65", 1))):
        changed = dict(parts, **{name: value})
        assert cache_key(changed) != cache.key, name
        other = CompileCache(cache_dir, cache_key(changed), changed)
        assert other.piece_files() == []
    # The compilation config is part of it (the eager backend compiles nothing).
    from tidal.engine_core.compilation_config import build_compilation_config

    base = build_compilation_config({"mode": 3, "cache_dir": str(cache_dir)})
    other = build_compilation_config({"mode": 3, "cache_dir": str(cache_dir),
                                      "backend": "eager"})
    common = dict(arch="a", dtype="d", parallel="p", rank=0, policy="k", device="cpu")
    assert (cache_key(key_parts(compilation=base, **common))
            != cache_key(key_parts(compilation=other, **common)))
    # ... but not where the cache lives.
    moved = build_compilation_config({"mode": 3, "cache_dir": "/elsewhere"})
    assert (cache_key(key_parts(compilation=base, **common))
            == cache_key(key_parts(compilation=moved, **common)))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_each_family_traces_as_one_graph(tiny_models, family):
    """The trace alone (pieces left uncompiled: ``backend`` eager): one graph, no break, the
    same hidden states as the eager model for 1, 5 and 8 tokens with no recompile."""
    from torch._dynamo.utils import counters

    folder, _ = tiny_models[family]
    config = EngineArgs(model=str(folder), num_kv_blocks=16, max_model_len=128, device="cpu",
                        dtype="float32", compilation_config={"mode": 3, "backend": "eager"}
                        ).create_config()
    worker = Worker(config)
    worker.load_model()
    runner = worker.runner
    runner.allocate_kv_cache(16)
    counters.clear()
    assert "pieces" in runner.compile_model()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    compiled = runner.compiled
    for n in (1, 5, 8):
        meta = runner._dummy_meta(n, 1)
        meta.slot_mapping = torch.full((n,), -1, dtype=torch.int64)  # writes nothing
        ids, pos = runner.bufs.input_ids[:n], runner.bufs.positions[:n]
        ids.copy_(torch.arange(n) * 7 % 300)
        pos.copy_(torch.arange(n))
        with torch.inference_mode():
            got, _ = compiled(ids, pos, meta)
            want, _ = runner.model(ids, pos, meta)
        torch.testing.assert_close(got, want)
    assert compiled.stats.dynamo_traces == 1
    assert compiled.stats.attention_calls == config.model.arch.num_layers


def test_a_model_with_a_graph_break_runs_eagerly_and_says_why(tiny_models, caplog):
    folder, _ = tiny_models["llama"]
    config = EngineArgs(model=str(folder), num_kv_blocks=16, max_model_len=128, device="cpu",
                        dtype="float32", hf_overrides=LAYERS,
                        compilation_config={"mode": 3, "backend": "eager"}).create_config()
    worker = Worker(config)
    worker.load_model()
    runner = worker.runner
    runner.allocate_kv_cache(16)
    attn = runner.model.layers["0"].self_attn
    plain = attn.attend_qkv

    def breaking(*args):
        torch._dynamo.graph_break()  # what an untraceable op does to the trace
        return plain(*args)

    attn.attend_qkv = breaking
    with caplog.at_level("WARNING"):
        detail = runner.compile_model()
    assert detail.startswith("off: DecoderForCausalLM could not be compiled as one graph")
    assert "falling back to the eager model" in caplog.text
    assert runner.compiled is None
    assert all(layer.op_index is None for layer in runner.model.attention_layers())


def test_a_backend_failure_is_named_by_its_cause():
    """Dynamo wraps a backend's error (``BackendCompilerFailed``: its first line names only the
    backend; the error is its ``inner_exception`` and its cause); the fallback's reason names
    the error underneath."""
    from tidal.worker.compilation.compiled_model import _root_cause

    class Wrapped(Exception):  # (Dynamo's class; its constructor differs across torch)
        def __init__(self, inner):
            super().__init__("backend='PiecewiseBackend' raised:\n" + str(inner))
            self.inner_exception = inner

    inner = ValueError("piece 3: an op Inductor cannot lower\nmore detail")
    assert _root_cause(Wrapped(inner)) == "ValueError: piece 3: an op Inductor cannot lower"
    try:
        try:
            raise inner
        except ValueError as err:
            raise RuntimeError("outer") from err
    except RuntimeError as exc:
        assert _root_cause(exc).startswith("ValueError: piece 3")
    assert _root_cause(RuntimeError("plain")) == "RuntimeError: plain"


def test_a_trace_failure_names_the_model_line_it_stopped_at():
    """A Dynamo failure inside the model says which line of it (its ``real_stack`` or the
    "from user code:" part of its message), so the fallback's warning points at the code."""
    from tidal.worker.compilation.compiled_model import _root_cause

    def branchy(x: torch.Tensor) -> torch.Tensor:
        n = x.nonzero().shape[0]
        if n == 1:  # a Python branch on a data-dependent size: no graph can hold it
            return x + 1
        return x - 1

    torch._dynamo.reset()
    with pytest.raises(Exception) as err:
        torch.compile(branchy, fullgraph=True, backend="eager")(torch.tensor([0.0, 1.0, 2.0]))
    line = branchy.__code__.co_firstlineno + 2
    why = _root_cause(err.value)
    assert why.endswith(f"test_compile.py:{line} in branchy"), why

    class Plain(Exception):  # (the message's form, when no stack is attached)
        pass

    text = ('Could not guard\n\nfrom user code:\n   File "/x/tidal/worker/models/decoder.py", '
            'line 9, in forward\n    h = a + b\n   File "/x/tidal/worker/models/decoder.py", '
            'line 431, in _run_layers_aux\n    state = hidden + residual\n')
    assert _root_cause(Plain(text)) == \
        "Plain: Could not guard at tidal/worker/models/decoder.py:431 in _run_layers_aux"


def test_inductor_fuses_the_norm_and_the_activation(compiled):
    """Evidence for leaning on Inductor instead of custom FX passes: in the saved pieces (the
    generated C++ kernels are named for the ops they fuse) the residual add and the RMSNorm
    after it are one kernel, SiLU and the multiply another, and the piece after the attention
    (o_proj, add + norm, gate/up, SiLU-and-mul, down, add + the final norm) runs three kernels
    besides its matmuls."""
    kernels = []
    for path in _runner(compiled).compiled.cache.piece_files():
        found = sorted(set(re.findall(rb"cpp_fused_[a-z0-9_]+", path.read_bytes())))
        kernels.append([k.decode() for k in found])
    assert all(kernels), kernels
    after_attention = [k for k in kernels if any("silu" in name for name in k)]
    assert after_attention, kernels
    for piece in after_attention:
        assert len(piece) <= 3, piece
        assert any("silu" in name and "mul" in name for name in piece), piece
        assert any("add" in name and "rsqrt" in name for name in piece), piece


def test_compiled_policy_leaves_the_fusions_to_inductor():
    """On a GPU the compiled model takes torch's fused ops (traceable; Inductor writes their
    kernels) and keeps the attention backend, an opaque op between the pieces."""
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import DeviceInfo, resolve

    gpu = DeviceInfo("cuda", triton=True, cuda_ext=True)
    eager = resolve(KernelConfig(), gpu)
    policy = resolve(KernelConfig(), gpu, compiled=True)
    assert (eager.ops, eager.decode_kernels, eager.attention) == ("cuda", True, "triton")
    assert (policy.ops, policy.decode_kernels, policy.gemv, policy.attention) == (
        "torch", False, False, "triton")
    assert "compiled" in policy.why("ops")
    assert resolve(KernelConfig(), DeviceInfo("cpu"), compiled=True).ops == "torch"


@pytest.mark.gpu
def test_compiled_matches_eager_on_gpu(tiny_models, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: Inductor's Triton pieces and the CUDA attention "
                    "between them")
    folder = tiny_models["qwen3"][0]
    kw = dict(skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=128, device="cuda",
              dtype="float32", max_num_batched_tokens=16, hf_overrides=LAYERS)
    outs = []
    for cc in (None, {"mode": 3, "cache_dir": str(tmp_path)}):
        llm = LLM(str(folder), compilation_config=cc, **kw)
        try:
            outs.append([o.outputs[0].token_ids for o in
                         llm.generate(PROMPTS, _params(), use_tqdm=False)])
            if cc is not None:
                assert _runner(llm).compiled.stats.dynamo_traces == 1
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]


@pytest.mark.gpu
def test_tensor_parallel_compiled_matches_eager_on_gpus(tiny_models, tmp_path, capfd):
    """TP=2 on two GPUs, compiled with FULL_AND_PIECEWISE (the all-reduces are
    ``tidal::all_reduce`` ops inside the compiled pieces, which the whole-model decode and
    mixed graphs capture; NCCL): the same greedy tokens as one eager GPU, on a cold start and
    on a warm one (both ranks load their plans, no trace)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs: tensor parallelism over NCCL, compiled")
    folder = str(tiny_models["qwen3"][0])
    kw = dict(skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=128, device="cuda",
              dtype="float32", max_num_batched_tokens=16, hf_overrides=LAYERS)
    runs = [(None, 1)] + [({"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE",
                            "cache_dir": str(tmp_path)}, 2)] * 2
    outs, logs = [], []
    for cc, tp in runs:
        llm = LLM(folder, compilation_config=cc, tensor_parallel_size=tp,
                  distributed_executor_backend="mp" if tp > 1 else None, **kw)
        try:
            outs.append([o.outputs[0].token_ids for o in
                         llm.generate(PROMPTS, _params(), use_tqdm=False)])
        finally:
            llm.shutdown()
        logs.append([line for line in capfd.readouterr().err.splitlines()
                     if " compile in " in line])
    assert outs[1] == outs[0] and outs[2] == outs[0]
    assert len(logs[1]) == 2 and all("trace" in line for line in logs[1]), logs[1]
    assert len(logs[2]) == 2 and all("warm start without a Dynamo trace" in line
                                     for line in logs[2]), logs[2]
    # Each rank's cache entry holds its pieces and the plan the warm start ran.
    entries = sorted(tmp_path.iterdir())
    assert len(entries) == 2 and all((e / "warm.json").exists() for e in entries)


@pytest.mark.slow
def test_tensor_parallel_compiles_and_warm_starts_together(qwen3, eager_out, tmp_path, capfd):
    """TP=2 over two CPU worker processes, compiled (the all-reduces are ``tidal::all_reduce``
    ops in each rank's trace, ``worker/distributed/collective_ops``): the same greedy tokens
    as one eager worker, logprobs within float32 noise of a different summation order. A
    second start on the same cache warm-starts on both ranks (they agree first), no trace."""
    def run() -> str:
        llm = _llm(qwen3, tensor_parallel_size=2, distributed_executor_backend="mp",
                   compilation_config={"mode": 3, "cache_dir": str(tmp_path)})
        try:
            got = _generate(llm)
        finally:
            llm.shutdown()
        assert [g[0] for g in got] == [w[0] for w in eager_out]
        for (_, lp_got, _), (_, lp_want, _) in zip(got, eager_out):
            assert max(abs(a - b) for a, b in zip(lp_got, lp_want)) < 1e-3
        return capfd.readouterr().err

    def compile_lines(err: str) -> list[str]:
        return sorted(line.split("tidal.worker.worker: ", 1)[-1]
                      for line in err.splitlines() if " compile in " in line)

    cold = compile_lines(run())
    assert len(cold) == 2 and all("trace" in line and "Inductor 3 piece" in line
                                  for line in cold), cold
    # Each rank compiled its own pieces and saved its plan (the key holds the rank).
    entries = sorted(tmp_path.iterdir())
    assert len(entries) == 2 and all((e / "warm.json").exists() for e in entries)
    warm = compile_lines(run())
    assert len(warm) == 2 and all("warm start without a Dynamo trace" in line
                                  for line in warm), warm
    # (One rank without a plan makes every rank trace: test_ranks_that_do_not_all_have_a_plan.)
