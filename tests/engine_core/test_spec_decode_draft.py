"""Speculative decoding with a draft model and an EAGLE-3 head, wired end to end: the config
(the draft's vocabulary and the head's target hidden size checked at start-up, each error
naming the field), and on tiny random-weight models on the CPU against the engine without
speculation: greedy output identical (a draft of another family and width, through chunked
prefill and preemption; an EAGLE-3 head in the EAGLE checkpoint layout), a draft that is the
target itself has every draft accepted, and seeded sampling (drafts drawn from q) reproducible.
"""

from __future__ import annotations

import pytest
import torch

import reference
from tidal.engine_core.config import ConfigError, EngineArgs
from tidal.engine_core.sampling_params import SamplingParams

K = 3
VOCAB, H, HEADS, KV_HEADS, INTER = 384, 64, 4, 2, 96
DRAFT_VOCAB = 128


def _eagle3_head(folder, *, target_hidden: int = H, seed: int = 3) -> None:
    reference.make_eagle3_head(folder, vocab=VOCAB, hidden=H, heads=HEADS, kv_heads=KV_HEADS,
                               inter=INTER, draft_vocab=DRAFT_VOCAB,
                               target_hidden=target_hidden, seed=seed)


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory):
    """Folders: the target (tiny Llama), a Qwen2 draft of half its width (same vocabulary), a
    Qwen2 of another vocabulary, an EAGLE-3 head and one trained on another width."""
    root = tmp_path_factory.mktemp("spec-drafts")
    out = {"target": tiny_models["llama"][0]}
    for name, over in (("small", {}), ("other_vocab", {"vocab_size": 512})):
        out[name] = root / name
        out[f"{name}_hf"] = reference.make_tiny_model(
            "qwen2", out[name], seed=1, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, **over)
    for name, width in (("eagle3", H), ("eagle3_wide", 2 * H)):
        out[name] = root / name
        out[name].mkdir()
        _eagle3_head(out[name], target_hidden=width)
    return out


def _config(target, spec, **kw):
    return EngineArgs(model=str(target), device="cpu", num_kv_blocks=64,
                      speculative_config=spec, **kw).create_config()


# --- config -------------------------------------------------------------------------------------


def test_model_methods_resolve_and_describe_the_draft(drafts):
    cfg = _config(drafts["target"], {"method": "draft_model", "model": str(drafts["small"]),
                                     "num_speculative_tokens": K})
    spec = cfg.speculative
    assert spec.uses_model and spec.model == str(drafts["small"])
    assert "hidden 32" in spec.describe() and "vocabulary 384" in spec.describe()
    head = _config(drafts["target"], {"method": "eagle3", "model": str(drafts["eagle3"]),
                                      "num_speculative_tokens": K}).speculative
    assert "draft vocabulary 128 of 384" in head.describe()
    assert "target layers [0, 1, 2]" in head.describe()


@pytest.mark.parametrize("method,draft,extra,needle", [
    ("draft_model", "other_vocab", {}, "512 tokens, the target's 384"),
    ("draft_model", "eagle3", {}, "use method 'eagle3'"),
    ("eagle3", "small", {}, "not an EAGLE-3 head"),
    ("eagle3", "eagle3_wide", {}, "hidden states of size 128, the target's are 64"),
    ("draft_model", "small", {"draft_tensor_parallel_size": 2}, "not yet"),
    ("draft_model", "small", {"prompt_lookup_max": 3}, "prompt_lookup_max applies"),
    ("draft_model", None, {}, "needs model"),
    ("ngram", "small", {}, "model applies to methods"),
])
def test_incompatible_drafts_are_refused(drafts, method, draft, extra, needle):
    spec = {"method": method, "num_speculative_tokens": K, **extra}
    if draft is not None:
        spec["model"] = str(drafts[draft])
    with pytest.raises(ConfigError, match="speculative-config") as info:
        _config(drafts["target"], spec)
    assert needle in str(info.value)


def test_sliding_window_targets_are_refused_for_now(tmp_path):
    reference.make_tiny_model("gemma2", tmp_path)
    with pytest.raises(ConfigError, match="sliding-window layers .* not yet"):
        _config(tmp_path, _spec("draft_model", tmp_path))


# --- end to end ---------------------------------------------------------------------------------

PROMPTS = [{"prompt_token_ids": ([3 + i, 4, 5, 6, 7] * 9)[:40 + i]} for i in range(3)] + [
    {"prompt_token_ids": list(range(100, 131))}]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
# float32 on a GPU too (where "auto" would run these float32 checkpoints in bfloat16): the drafts
# are compared with a float32 pass on the CPU, and the random heads' top logits can be closer
# than bfloat16 resolves (an H200 run drafted 4 of 112 proposals differently, all at gaps under
# 0.04, the same with and without graphs or async scheduling).
KW = dict(skip_tokenizer_init=True, max_num_seqs=4, max_model_len=96, dtype="float32")


def _generate(llm, params, prompts=PROMPTS):
    """Token ids per prompt, and (drafts, draft tokens, accepted tokens) over the run."""
    outs, counts = reference.generate_counting_spec(llm, prompts, params)
    return [o.outputs[0].token_ids for o in outs], counts


@pytest.fixture(scope="module")
def plain(drafts):
    from tidal.frontend import LLM

    llm = LLM(str(drafts["target"]), kv_cache_memory_bytes=64 << 20, **KW)
    try:
        return _generate(llm, GREEDY)[0]
    finally:
        llm.shutdown()


def _spec(method, model):
    # (The off-switch stays out of it: every step with drafts verifies them.)
    return {"method": method, "model": str(model), "num_speculative_tokens": K,
            "disable_by_batch_size": None, "disable_by_acceptance": False}


SEEDED = [SamplingParams(max_tokens=24, temperature=0.9, seed=s, ignore_eos=True)
          for s in (7, 7, 8)]


def _check_seeds(llm):
    """Drafts drawn from the draft's q: the same seed gives the same output, batched or
    not, run after run; another seed another one."""
    prompts = [PROMPTS[0]] * 3
    first, _ = _generate(llm, SEEDED, prompts)
    again, _ = _generate(llm, SEEDED, prompts)
    alone, _ = _generate(llm, SEEDED[0], prompts[:1])
    assert first == again
    assert first[0] == first[1] == alone[0] and first[0] != first[2]


@pytest.mark.slow
def test_draft_model_greedy_identical_through_chunked_prefill_and_preemption(drafts, plain):
    from tidal.frontend import LLM

    # A token budget of 16 (prompts in chunks, drafts cut to the budget left) and a pool of
    # 12 blocks of 16 tokens for 4 requests of up to 75 tokens: requests are preempted.
    llm = LLM(str(drafts["target"]), speculative_config=_spec("draft_model", drafts["small"]),
              max_num_batched_tokens=16, num_kv_blocks=12, block_size=16, **KW)
    preempted = reference.record_preemptions(llm)
    try:
        proposed = _record_drafts(llm)
        got, (n_drafts, _, _) = _generate(llm, GREEDY)
        assert got == plain
        assert n_drafts > 0 and preempted
        assert _uniform_steps(llm) > 0
        # Proposals launched from the verify step's outputs, before the host has them.
        assert _early_steps(llm) > 0
        # The draft's cache, caught up in passes and refilled after preemption, drafts what
        # the draft run alone (HF) does after each sequence.
        _check_drafts_alone(drafts, "draft_model", proposed)
    finally:
        llm.shutdown()
    # (Preemption changes which steps draft, so seeds are checked on an engine without it.)
    llm = LLM(str(drafts["target"]), speculative_config=_spec("draft_model", drafts["small"]),
              kv_cache_memory_bytes=64 << 20, **KW)
    try:
        _check_seeds(llm)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_the_target_as_its_own_draft_has_every_draft_accepted(drafts, plain):
    from tidal.frontend import LLM

    llm = LLM(str(drafts["target"]), kv_cache_memory_bytes=64 << 20,
              speculative_config=_spec("draft_model", drafts["target"]), **KW)
    try:
        got, (n_drafts, n_tokens, accepted) = _generate(llm, GREEDY)
        assert got == plain
        assert _uniform_steps(llm) > 0
        # Mean acceptance length k + 1: every draft accepted, and only a request's last
        # drafts cut short (by its length limit).
        assert accepted == n_tokens > 0
        assert n_tokens >= K * (n_drafts - len(PROMPTS))
        # Sampled: drafts drawn from q = the target's own p are accepted with probability
        # min(1, p / q) = 1 when verified against the right q (a one-hot q, or another
        # position's, would reject most of these flat random-model draws).
        sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
        _, (_, n_tokens, accepted) = _generate(llm, sampled)
        assert n_tokens > 0 and accepted >= 0.95 * n_tokens
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_nothing_is_proposed_where_the_off_switch_would_drop_it(drafts, plain):
    """Above the off-switch's batch size the workers are not asked for drafts (proposing would
    be pure cost: the scheduler would drop them); the output stays the plain engine's."""
    from tidal.frontend import LLM

    spec = {**_spec("draft_model", drafts["small"]), "disable_by_batch_size": 2}
    llm = LLM(str(drafts["target"]), kv_cache_memory_bytes=64 << 20, speculative_config=spec,
              **KW)
    try:
        drafter = llm.engine.core.executor.worker.runner.spec.drafter
        calls = []
        propose = drafter.propose

        def counting(b, rows, limits, *args):
            calls.append(len(rows))
            return propose(b, rows, limits, *args)

        drafter.propose = counting
        got, (n_drafts, _, _) = _generate(llm, GREEDY)  # 4 requests: above the limit
        assert got == plain
        # Prompt chunks still feed the draft (rows=0 calls); no proposal for decodes.
        assert n_drafts == 0 and not any(calls)
        calls.clear()
        alone, (n_drafts, _, _) = _generate(llm, GREEDY, PROMPTS[:2])  # at the limit: drafts
        assert alone == plain[:2] and n_drafts > 0 and any(calls)
    finally:
        llm.shutdown()


def _early_steps(llm) -> int:
    """Uniform proposals launched from the verify step's device outputs (``propose_early``;
    on a CPU the same step, run from the tensors' values)."""
    return llm.engine.core.executor.worker.runner.spec.drafter.early_steps


def _uniform_steps(llm) -> int:
    """Proposals that took the uniform step (``spec_decode.uniform_propose``: every request
    k + 1 rows, all on the device; captured in a CUDA graph on a GPU)."""
    return llm.engine.core.executor.worker.runner.spec.drafter.uniform_steps


def _record_drafts(llm) -> list[tuple[list[int], list[int]]]:
    """(a request's tokens, the drafts the workers proposed after them), step by step."""
    scheduler = llm.engine.core.scheduler
    update = scheduler.update_from_output
    seen: list[tuple[list[int], list[int]]] = []

    def recording(sched, result):
        outputs = update(sched, result)
        for rid, drafts in zip(result.req_ids, result.spec_token_ids or []):
            req = scheduler.requests.get(rid)
            if drafts and req is not None and not req.is_finished:
                seen.append((list(req.all_token_ids), list(drafts)))
        return outputs

    scheduler.update_from_output = recording
    return seen


@torch.inference_mode()
def _eagle3_from_scratch(target: str, head: str, tokens: list[int]) -> list[int]:
    """The head's drafts after ``tokens``, from one pass of the target over the whole
    sequence on a fresh cache (what the engine's step-by-step drafting must equal)."""
    import numpy as np

    from tidal.worker.attention.backend import kv_cache_shape
    from tidal.worker.attention.torch_backend import TorchAttention
    from tidal.worker.loader.model_loader import load_model
    from tidal.worker.models.decoder import AuxHiddenSpec
    from tidal.worker.spec_decode.draft_proposer import (
        Eagle3Proposer,
        draft_model_config,
        make_batch,
    )

    cpu, block = torch.device("cpu"), 16
    cfg = EngineArgs(model=target, device="cpu", num_kv_blocks=8,
                     max_model_len=128).create_config()
    model = load_model(cfg.model, cpu, TorchAttention(), aux_hidden=AuxHiddenSpec((0, 1, 2), 128))
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(kv_cache_shape(8, block, layer.num_kv_heads,
                                                    layer.head_dim))
        layer.kv_group = 0
    head = load_model(draft_model_config(head, cfg.model), cpu, TorchAttention())
    proposer = Eagle3Proposer(head, K, model, cfg.model.max_model_len)
    proposer.bind_kv_cache(8, block)
    table = torch.arange(8, dtype=torch.int32).unsqueeze(0)
    n = len(tokens) - 1  # rows 0 .. n - 1, row t holding token t + 1
    start = np.zeros(1, dtype=np.int64)
    target_rows = make_batch(torch.tensor(tokens[:n]), np.array([n]), start, table, block)
    model(target_rows.input_ids, target_rows.positions, target_rows.meta)
    batch = make_batch(torch.tensor(tokens[1:]), np.array([n]), start, table, block,
                       hidden=model.aux_hidden_states[:n])
    return proposer.propose(batch).token_ids[0].tolist()


def _check_drafts_alone(drafts, method: str, proposed) -> None:
    """Every few recorded proposals: the drafts equal what the draft model (HF) or the EAGLE-3
    head (one fresh pass) drafts after that sequence alone."""
    for tokens, drafts_then in proposed[::5 if method == "draft_model" else 7]:
        if method == "draft_model":
            want = reference.hf_greedy(drafts["small_hf"], tokens, K)[0]
        else:
            want = _eagle3_from_scratch(str(drafts["target"]), str(drafts["eagle3"]), tokens)
        assert drafts_then == want[:len(drafts_then)], len(tokens)


@pytest.mark.slow
def test_eagle3_greedy_identical_and_seeds_reproducible(drafts, plain):
    from tidal.frontend import LLM

    # A token budget of 16: prompts in chunks (the head reads each chunk's hidden states).
    llm = LLM(str(drafts["target"]), kv_cache_memory_bytes=64 << 20,
              max_num_batched_tokens=16, speculative_config=_spec("eagle3", drafts["eagle3"]),
              **KW)
    try:
        proposed = _record_drafts(llm)
        got, (n_drafts, _, _) = _generate(llm, GREEDY)
        assert got == plain
        assert n_drafts > 0 and _uniform_steps(llm) > 0
        # The head's cache, filled step by step over prompt chunks, verify rows (rejected
        # ones overwritten later) and chains, drafts what a fresh pass over each sequence does.
        _check_drafts_alone(drafts, "eagle3", proposed)
        _check_seeds(llm)
    finally:
        llm.shutdown()


def _quantized_params(model: torch.nn.Module) -> list[str]:
    """Names of ``model``'s FP8 or packed INT4 tensors."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [n for n, t in named if t.dtype == torch.float8_e4m3fn or n.endswith("qweight")]


@pytest.mark.slow
@pytest.mark.parametrize("quant,method", [("fp8", "eagle3"), ("awq", "draft_model")])
def test_a_quantized_target_verifies_a_16_bit_draft(drafts, tiny_models, tmp_path, quant,
                                                    method):
    """``--quantization`` with a draft model or an EAGLE-3 head: the target's weights are
    quantized (FP8 on load; an AWQ checkpoint), the draft's are not (its checkpoint has no
    quantized tensors), and speculation leaves the quantized target's greedy output as it
    was, drafts accepted."""
    from tests.worker.int4_writer import write_int4_checkpoint
    from tidal.frontend import LLM

    target, kw = str(drafts["target"]), dict(KW, kv_cache_memory_bytes=64 << 20)
    if quant == "awq":
        target = str(tmp_path / "awq")
        write_int4_checkpoint(drafts["target"], tmp_path / "awq", tiny_models["llama"][1],
                              "awq", group_size=32, dequantize=False)
    else:
        kw["quantization"] = quant
    plain = LLM(target, **kw)
    try:
        want, _ = _generate(plain, GREEDY)
    finally:
        plain.shutdown()
    draft = drafts["eagle3" if method == "eagle3" else "small"]
    llm = LLM(target, speculative_config=_spec(method, draft), **kw)
    try:
        got, (n_drafts, _, accepted) = _generate(llm, GREEDY)
        assert got == want
        # (The random EAGLE-3 head's drafts are all rejected, so only the draft model's run
        # shows accepted drafts too; its seeds make some land.)
        assert n_drafts > 0 and (accepted > 0 or method == "eagle3")
        runner = llm.engine.core.executor.worker.runner
        assert _quantized_params(runner.model)
        assert not _quantized_params(runner.spec.drafter.proposer.model)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_dummy_weights_apply_to_the_draft_too(drafts, tmp_path):
    """``load_format="dummy"``: the draft needs only its config (as ``tools/bench_spec.py
    --draft-shape`` runs one), and greedy output is the dummy target's."""
    from tidal.frontend import LLM

    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text((drafts["eagle3"] / "config.json").read_text())
    kw = dict(KW, load_format="dummy", kv_cache_memory_bytes=64 << 20)
    outs = []
    for spec in (None, _spec("eagle3", head)):
        llm = LLM(str(drafts["target"]), speculative_config=spec, **kw)
        try:
            outs.append(_generate(llm, GREEDY))
        finally:
            llm.shutdown()
    (want, _), (got, (n_drafts, _, _)) = outs
    assert got == want and n_drafts > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_async_scheduling_pipelines_speculative_steps(drafts, plain, method):
    """Async scheduling with a model drafter: a step that verifies or proposes drafts no
    longer runs alone. The next step is scheduled while it is in flight, with placeholder
    drafts the worker fills from the proposal it left on the device, and computed counts that
    assume every draft accepted (the worker steps them back by what was rejected). Greedy
    output stays the plain engine's through chunked prefill, preemption and requests ending
    at different lengths; seeded sampling stays reproducible."""
    from tidal.frontend import LLM

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (32, 24, 32, 28)]
    model = drafts["small"] if method == "draft_model" else drafts["eagle3"]
    llm = LLM(str(drafts["target"]), speculative_config=_spec(method, model),
              max_num_batched_tokens=16, num_kv_blocks=12, block_size=16,
              async_scheduling=True, **KW)
    core = llm.engine.core
    runner = core.executor.worker.runner
    preempted = reference.record_preemptions(llm)
    ahead: list[int] = []  # per step scheduled with a speculative step in flight: its drafts
    launch = core.executor.execute_model

    def recording(sched, *args, **kwargs):
        if sched.spec_in_flight:
            assert core.batch_queue  # (the step it follows is still in flight)
            ahead.append(sum(len(d) for d in sched.scheduled_spec_decode_tokens.values()))
        return launch(sched, *args, **kwargs)

    core.executor.execute_model = recording
    fills: list[int] = []
    fill = runner.spec.fill_device_drafts

    def counting_fills(input_ids, dst, *args):
        fills.append(len(dst))
        return fill(input_ids, dst, *args)

    runner.spec.fill_device_drafts = counting_fills
    proposed = _record_drafts(llm)
    try:
        got, (n_drafts, _, accepted) = _generate(llm, params)
        assert got == [p[:n] for p, n in zip(plain, (32, 24, 32, 28))]
        assert n_drafts > 0 and preempted
        # Steps were scheduled behind a speculative one, verifying placeholder drafts the
        # worker took from the device.
        assert len(ahead) > 5 and sum(ahead) > 0 and sum(fills) > 0
        if method == "draft_model":  # (the random EAGLE-3 head's drafts are all rejected)
            assert accepted > 0 and _early_steps(llm) > 0
        # What the drafter left on the device (and copied to the host for the output) is
        # what it drafts from each sequence alone.
        _check_drafts_alone(drafts, method, proposed)
        _check_seeds(llm)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_requests_near_max_tokens_keep_the_proposal_uniform(drafts, plain):
    """Requests ending at different lengths verify k drafts up to their last step (what they
    emit past max_tokens is dropped), and one whose drafts in flight may still be rejected is
    scheduled behind them: every step verifies k drafts a request, so every proposal after a
    verify step is the uniform one (one graph replay on a GPU). The general path, whose host
    work and launches cost a batch-64 step milliseconds there, runs for prompt rows only."""
    from tidal.frontend import LLM

    lengths = (13, 22, 17, 30)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    llm = LLM(str(drafts["target"]), speculative_config=_spec("eagle3", drafts["eagle3"]),
              kv_cache_memory_bytes=64 << 20, async_scheduling=True, **KW)
    drafter = llm.engine.core.executor.worker.runner.spec.drafter
    general: list[list[int]] = []  # each general step's rows a request
    draft = drafter._draft

    def recording(b, rows, ids, counts, *args, **kwargs):
        general.append(counts.tolist())
        return draft(b, rows, ids, counts, *args, **kwargs)

    drafter._draft = recording
    try:
        got, (n_drafts, _, _) = _generate(llm, params)
        assert got == [p[:n] for p, n in zip(plain, lengths)]
        assert n_drafts > 0 and _uniform_steps(llm) >= max(lengths) - 2
        assert general and all(max(c) > K + 1 for c in general), general
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_async_speculative_steps_through_worker_processes(drafts, plain):
    """The same with the worker in its own process (the multiprocess executor): it resolves
    the step in flight before the next one, and sends a step's output only once the next step
    is launched (its drafts then copied from the device). (Speculation with tensor
    parallelism is refused for now.)"""
    from tidal.frontend import LLM

    llm = LLM(str(drafts["target"]), speculative_config=_spec("draft_model", drafts["small"]),
              kv_cache_memory_bytes=64 << 20, async_scheduling=True,
              distributed_executor_backend="mp", **KW)
    core = llm.engine.core
    ahead = []
    launch = core.executor.execute_model

    def recording(sched, *args, **kwargs):
        ahead.append(sched.spec_in_flight)
        return launch(sched, *args, **kwargs)

    core.executor.execute_model = recording
    try:
        got, (n_drafts, _, accepted) = _generate(llm, GREEDY)
        assert got == plain
        assert n_drafts > 0 and accepted > 0 and sum(ahead) > 5
    finally:
        llm.shutdown()
