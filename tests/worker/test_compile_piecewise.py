"""Piecewise CUDA graphs around the compiled pieces (``cudagraph_mode`` PIECEWISE /
FULL_AND_PIECEWISE, ``tidal.worker.compilation.piecewise_graphs``).

On a CPU: the capture sizes, the padding choice and the config's checks; and the whole
mechanism (static inputs, attention outputs staged into shared buffers, padded steps, steps
above the largest size) through the real engine, with a stand-in for ``torch.cuda.CUDAGraph``
that does to memory what a graph does: a replay reads the captured inputs' memory and writes
the captured outputs' memory (and nothing else). The pieces are left uncompiled (``backend``
eager: same split graph, no Inductor on two cores). The ``gpu`` tests at the end run real CUDA
graphs over Inductor's Triton pieces."""

from __future__ import annotations

import pytest
import torch

from tidal.engine_core.compilation_config import (
    build_compilation_config,
    check_combination,
    describe,
)
from tidal.engine_core.config import ConfigError, EngineArgs
from tidal.frontend import LLM, SamplingParams
from tidal.worker.compilation import piecewise_graphs as pg
from tidal.worker.compilation.compile_cache import cache_key, key_parts

LAYERS = {"num_hidden_layers": 2}
PROMPTS = [list(range(3, 40)), [5, 9, 2, 7, 1], [11] * 17]
# A 3-token prompt beside a 20-token one: 3 + 13 prompt tokens, then one decode + the last 7
# prompt tokens, a mixed step of 8 (a padded graph step), then decodes.
MIXED = [[5, 9, 2], list(range(50, 70))]
SHORT = [[4, 4, 8, 1, 3, 3]]  # alone: a 6-token prompt step (padded to 8)
SIZES = [2, 4, 8]  # the stand-in engine's capture sizes: a 16-token step runs without graphs


def _params() -> list[SamplingParams]:
    # Different lengths: decode batches of 3, 2 and 1 requests (padded to 4, 2, 1).
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
            for n in (5, 8, 11)]


def _kw(**extra) -> dict:
    # A 16-token budget chunks the 37-token prompt: prefill chunks of 16 (above every capture
    # size), mixed prefill + decode steps of 6..16 tokens, decode steps of 1..3.
    return dict(skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=128, max_num_seqs=4,
                max_num_batched_tokens=16, hf_overrides=LAYERS, **extra)


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    out = []
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    outs += llm.generate(MIXED, _params()[:2], use_tqdm=False)
    outs += llm.generate(SHORT, _params()[:1], use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        out.append((list(c.token_ids),
                    [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]))
    return out


def _assert_same(got, want, tol: float) -> None:
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, a), (_, b) in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a, b)) < tol


def _runner(llm: LLM):
    return llm.engine.core.executor.worker.runner


# --- sizes and padding -------------------------------------------------------------------------

def test_default_capture_sizes_follow_vllms_grid():
    sizes = pg.default_capture_sizes(8192)
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert sizes[-1] == 512 and 256 in sizes and 264 not in sizes and 272 in sizes
    assert all(b - a == 8 for a, b in zip(sizes[3:34], sizes[4:34]))  # 8..256 by 8
    assert all(b - a == 16 for a, b in zip(sizes[34:], sizes[35:]))  # then by 16
    # Never above the rows a step holds (that count itself is captured).
    assert pg.default_capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80,
                                             88, 96, 100]
    assert pg.piecewise_sizes((24, 3, 3, 99), max_num_tokens=64) == [3, 24]
    assert pg.piecewise_sizes(None, max_num_tokens=6) == [1, 2, 4, 6]
    # FULL_AND_PIECEWISE with whole-model mixed graphs: only larger sizes are captured
    # piecewise; with the default 2048-token mixed graphs the default grid adds none.
    assert pg.piecewise_sizes(None, max_num_tokens=8192, above=2048) == []
    assert pg.piecewise_sizes((8, 512, 4096), max_num_tokens=8192, above=2048) == [4096]
    assert pg.piecewise_sizes(None, max_num_tokens=8192, above=480) == [496, 512]


@pytest.mark.parametrize("n, want", [(1, 2), (2, 2), (3, 4), (5, 8), (8, 8), (9, None)])
def test_a_step_pads_to_the_next_captured_size(n, want):
    assert pg.padded_size(SIZES, n) == want


def test_a_weak_reference_aliases_without_owning():
    base = torch.arange(12.0).reshape(3, 4)
    view = base[1:, 1:]
    weak = pg.weak_ref(view)
    assert (weak.data_ptr(), weak.shape, weak.stride()) == (view.data_ptr(), view.shape,
                                                            view.stride())
    base[2, 3] = -1.0
    assert weak[1, 2].item() == -1.0  # the same memory
    # A storage of its own over that memory (built from the address, with no owner), not a
    # share of the tensor's: it keeps nothing alive, so the pool may reuse the memory.
    assert weak.untyped_storage()._cdata != view.untyped_storage()._cdata
    assert pg.weak_ref(3) == 3


# --- the config ---------------------------------------------------------------------------------

def test_piecewise_modes_and_sizes_are_accepted():
    cc = build_compilation_config({"mode": 3, "cudagraph_mode": "piecewise",
                                   "cudagraph_capture_sizes": [8, 1, 4, 4]})
    assert (cc.cudagraph_mode, cc.cudagraph_capture_sizes, cc.piecewise) == (
        "PIECEWISE", (1, 4, 8), True)
    line = describe(cc, "cuda")
    assert "every piece a graph per capture size" in line and "[1, 4, 8]" in line
    both = build_compilation_config({"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE",
                                     "cudagraph_capture_sizes": []})
    assert both.piecewise and both.cudagraph_capture_sizes is None
    assert not build_compilation_config({"mode": 3, "cudagraph_mode": "FULL"}).piecewise
    # The pieces are the same whatever graphs are captured around them: one cache entry.
    common = dict(arch="a", dtype="d", parallel="p", rank=0, policy="k", device="cuda")
    plain = build_compilation_config({"mode": 3, "cache_dir": "/c"})
    assert cache_key(key_parts(compilation=plain, **common)) == cache_key(
        key_parts(compilation=build_compilation_config(
            {"mode": 3, "cache_dir": "/c", "cudagraph_mode": "PIECEWISE",
             "cudagraph_capture_sizes": [4]}), **common))


@pytest.mark.parametrize("raw, words", [
    ({"cudagraph_mode": "PIECEWISE"}, ["cudagraph_mode PIECEWISE needs mode 3"]),
    ({"mode": 3, "cudagraph_capture_sizes": [1, 2]}, ["cudagraph_capture_sizes",
                                                      "not yet supported", "FULL"]),
    ({"mode": 3, "cudagraph_mode": "NONE", "cudagraph_capture_sizes": [4]},
     ["cudagraph_capture_sizes", "NONE"]),
    ({"mode": 3, "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [0]},
     ["cudagraph_capture_sizes", "1..8192"]),
    ({"mode": 3, "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [True]},
     ["cudagraph_capture_sizes"]),
    ({"mode": 3, "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": 8},
     ["cudagraph_capture_sizes must be a list"]),
    ({"mode": 3, "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [9000]},
     ["1..8192"]),
])
def test_bad_piecewise_config_names_the_field(raw, words):
    with pytest.raises(ConfigError) as info:
        build_compilation_config(raw)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_piecewise_is_refused_where_it_cannot_run(tiny_models):
    cc = build_compilation_config({"mode": 3, "cudagraph_mode": "PIECEWISE",
                                   "cudagraph_capture_sizes": [64]})
    base = dict(task="generate", pipeline_parallel_size=1)
    check_combination(cc, **base, device="cuda", max_num_tokens=64)
    for kw, word in ((dict(device="cpu"), "needs a CUDA device"),
                     (dict(enforce_eager=True), "enforce_eager"),
                     (dict(max_num_tokens=32), "above the 32 tokens")):
        with pytest.raises(ConfigError, match=word):
            check_combination(cc, **base, **{"device": "cuda", **kw})
    # Through the engine config: a CPU engine refuses it, naming the field.
    with pytest.raises(ConfigError, match="cudagraph_mode FULL_AND_PIECEWISE needs a CUDA"):
        EngineArgs(model=str(tiny_models["qwen3"][0]), device="cpu",
                   compilation_config={"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}
                   ).create_config()


# --- the mechanism, on a CPU with stand-in graphs ---------------------------------------------

class _StandInGraph:
    """A CUDA graph's memory contract on a CPU: ``capture`` runs ``fn`` once on the static
    inputs and keeps its outputs; ``replay`` runs it again on the same input objects and writes
    the results into the captured outputs. Anything a replay should have read from elsewhere
    (an input that moved, an attention output not staged) would give wrong tokens."""

    def capture(self, fn, args):
        self.fn, self.args = fn, list(args)
        self.out = fn(*self.args)
        return self.out

    def replay(self):
        new = self.fn(*self.args)
        outs = self.out if isinstance(self.out, (list, tuple)) else [self.out]
        news = new if isinstance(new, (list, tuple)) else [new]
        for dst, src in zip(outs, news):
            if isinstance(dst, torch.Tensor) and dst.data_ptr() != src.data_ptr():
                dst.copy_(src)


@pytest.fixture(scope="module")
def qwen3(tiny_models):
    return tiny_models["qwen3"][0]


@pytest.fixture(scope="module")
def eager_out(qwen3):
    llm = LLM(str(qwen3), **_kw(dtype="float32", cpu_threads=1))
    try:
        return _generate(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def stand_in(qwen3):
    """An engine whose compiled pieces replay stand-in graphs of SIZES tokens."""
    from tidal.worker import model_runner

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_runner.ModelRunner, "_piecewise_sizes", lambda self: list(SIZES))
        mp.setattr(model_runner, "PiecewiseGraphs",
                   lambda sizes: pg.PiecewiseGraphs(sizes, new_graph=_StandInGraph,
                                                    weak_outputs=False))
        llm = LLM(str(qwen3), **_kw(dtype="float32", cpu_threads=1, async_scheduling=True,
                                    compilation_config={"mode": 3, "backend": "eager"}))
    yield llm
    llm.shutdown()


def test_padded_piecewise_steps_match_eager(stand_in, eager_out):
    graphs = _runner(stand_in).compiled.graphs
    assert graphs.captured == SIZES and len(graphs) == 3 * len(SIZES)  # 3 pieces a size
    before = (graphs.replays, graphs.graph_steps, graphs.ungraphed_steps)
    compiled = _runner(stand_in).compiled
    log = []  # per step: (tokens, longest query, decodes first, ran as graphs)
    plain_run = compiled.run

    def spy(ids, pos, meta, buffers=None):
        replays = graphs.replays
        out = plain_run(ids, pos, meta, buffers)
        log.append((ids.shape[0], meta.max_query_len, meta.num_decodes,
                      graphs.replays > replays))
        return out

    compiled.run = spy
    try:
        got = _generate(stand_in)
    finally:
        del compiled.run
    _assert_same(got, eager_out, 1e-4)
    replays, steps, ungraphed = (a - b for a, b in zip(
        (graphs.replays, graphs.graph_steps, graphs.ungraphed_steps), before))
    assert steps > 0 and replays == 3 * steps  # every piece of every padded step replayed
    assert ungraphed > 0  # the 16-token prefill chunks: above the largest size, still right
    # Decode batches (3 -> 4 rows, 2, 1), a mixed step and a prompt step replayed graphs.
    assert {(n, q) for n, q, _, g in log if g and q == 1} >= {(3, 1), (2, 1), (1, 1)}
    assert any(g and q > 1 and d > 0 for _, q, d, g in log), log
    assert any(g and q > 1 and d == 0 for _, q, d, g in log), log
    assert any(not g and n > SIZES[-1] for n, _, _, g in log), log
    assert _runner(stand_in).compiled.stats.dynamo_traces == 1


def test_attention_outputs_are_the_only_staged_inputs(stand_in):
    """Each piece after an attention call copies that call's output into a staging buffer
    shared by every size; everything else it reads (weights, the step buffers, the previous
    piece's outputs) sits where it sat at capture."""
    graphs = _runner(stand_in).compiled.graphs
    for (index, size), entry in graphs._entries.items():
        assert len(entry.copies) == (0 if index == 0 else 1), (index, size)
        assert all(rows.shape[0] == size for _, rows in entry.copies)
        assert entry.pinned and all(v == size for _, v in entry.sizes)
    staging = {rows.data_ptr() for e in graphs._entries.values() for _, rows in e.copies}
    assert len(staging) == 1


def test_a_moved_input_is_an_error_not_a_wrong_answer(stand_in):
    graphs = _runner(stand_in).compiled.graphs
    index, size = 0, SIZES[0]
    entry = graphs._entries[(index, size)]
    i, _ = entry.pinned[0]
    args = [None] * (max(j for j, _ in entry.pinned + entry.sizes) + 1)
    for j, v in entry.sizes:
        args[j] = v
    for j, _ in entry.pinned:
        args[j] = torch.zeros(size, dtype=torch.int64)  # not the captured buffers
    with pytest.raises(RuntimeError, match="moved since capture"):
        graphs._replay(entry, args)


# --- on a GPU ---------------------------------------------------------------------------------

def _gpu_kw(**extra) -> dict:
    return _kw(device="cuda", dtype="float32", **extra)


def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: piecewise CUDA graphs over Inductor's Triton pieces")


@pytest.mark.gpu
def test_piecewise_graphs_match_eager_on_gpu(tiny_models, tmp_path):
    """Greedy tokens of eager (its own whole-model graphs), compiled + PIECEWISE and compiled +
    FULL_AND_PIECEWISE are identical over prefill chunks (16 tokens: above the largest capture
    size, run without graphs), mixed steps and decode batches of 3, 2, 1 (padded); the
    second compiled engine is a warm start on the first's cache (no Dynamo trace).
    FULL_AND_PIECEWISE's whole-model mixed graphs hold steps of up to 8 tokens here (the
    mixed step of 8), so its piecewise graphs are of the given sizes above that: 16 only (the
    prefill chunks)."""
    _needs_cuda()
    folder = str(tiny_models["qwen3"][0])
    outs = {}
    for label, cc in (("eager", None),
                      ("piecewise", {"mode": 3, "cudagraph_mode": "PIECEWISE",
                                     "cudagraph_capture_sizes": [1, 2, 4, 8],
                                     "cache_dir": str(tmp_path)}),
                      ("full_and_piecewise", {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE",
                                              "cudagraph_capture_sizes": [1, 2, 4, 8, 16],
                                              "cache_dir": str(tmp_path)})):
        mixed = {"max_mixed_cudagraph_tokens": 8} if label == "full_and_piecewise" else {}
        llm = LLM(folder, compilation_config=cc, **_gpu_kw(**mixed))
        try:
            outs[label] = _generate(llm)
            runner = _runner(llm)
            if cc is None:
                continue
            graphs = runner.compiled.graphs
            want = [1, 2, 4, 8] if label == "piecewise" else [16]
            assert graphs is not None and graphs.captured == want, label
            assert graphs.replays > 0 and graphs.graph_steps > 0, label
            if label == "piecewise":
                assert graphs.ungraphed_steps > 0, label  # the 16-token chunks
            # The second compiled engine shares the first's cache entry (the graph mode is
            # not in its key): a warm start, rebuilt from the plan without Dynamo.
            stats = runner.compiled.stats
            if label == "piecewise":
                assert (stats.dynamo_traces, stats.warm_start) == (1, False)
            else:
                assert (stats.dynamo_traces, stats.warm_start) == (0, True), stats
            # PIECEWISE: no whole-model graphs; FULL_AND_PIECEWISE: decode ones and mixed
            # ones of up to 8 tokens, capturing the compiled forward.
            if label == "piecewise":
                assert runner.graphs is None
            else:
                assert runner.graphs is not None and runner.graphs.mixed_sizes == [8]
                assert runner.graphs.mixed_replays > 0, "no mixed step replayed a whole graph"
        finally:
            llm.shutdown()
    assert [t for t, _ in outs["piecewise"]] == [t for t, _ in outs["eager"]]
    assert [t for t, _ in outs["full_and_piecewise"]] == [t for t, _ in outs["eager"]]
    _assert_same(outs["piecewise"], outs["eager"], 1e-3)


@pytest.mark.gpu
def test_piecewise_graph_replay_matches_the_pieces_on_gpu(tiny_models, tmp_path):
    """One padded forward of every token count 1..10 through the graphs (sizes 1, 4, 8; 9 and
    10 above them) against the same compiled model without graphs, on the runner's buffers;
    the graphs' pool is shared and freed outputs reused across sizes, so a wrong reuse shows
    here as a mismatch."""
    _needs_cuda()
    folder = str(tiny_models["qwen3"][0])
    cc = {"mode": 3, "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 4, 8],
          "cache_dir": str(tmp_path)}
    llm = LLM(folder, compilation_config=cc, **_gpu_kw())
    try:
        runner = _runner(llm)
        compiled, bufs = runner.compiled, runner.bufs
        graphs = compiled.graphs
        gen = torch.Generator(device="cuda").manual_seed(0)
        with torch.inference_mode():
            for n in range(1, 11):
                meta = runner._dummy_meta(n, 1)
                meta.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device="cuda")
                bufs.input_ids[:16].copy_(torch.randint(0, 300, (16,), device="cuda",
                                                        generator=gen))
                bufs.positions[:16].copy_(torch.arange(16, device="cuda"))
                ids, pos = bufs.input_ids[:n], bufs.positions[:n]
                want, _ = compiled(ids, pos, meta)
                want = want.clone()
                replays = graphs.replays
                got, _ = compiled.run(ids, pos, meta, (bufs.input_ids, bufs.positions))
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
                assert (graphs.replays > replays) == (n <= 8), n
    finally:
        llm.shutdown()
