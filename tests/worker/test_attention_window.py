"""Sliding-window and logit soft-cap attention: the torch backend (the CPU path and the reference
the GPU kernels are tested against) against a dense float64 attention written from the
definition, and the layer's interface; plus tiny Mistral
and Qwen2 models with a window shorter than their prompts against HF transformers."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import reference
from tidal.worker.attention.backend import AttentionMetadata
from tidal.worker.attention.torch_backend import TorchAttention, write_kv_reference
from tidal.worker.layers.attention import Attention

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def dense_attention(q, k, v, scale, window, cap):
    """One sequence, every position a query: ``q [T, H, D]``, ``k, v [T, Hkv, D]``; float64.
    Row p sees keys p - window < j <= p; scores capped as c * tanh(s / c)."""
    t = q.shape[0]
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    p = torch.arange(t)
    visible = p[None, :] <= p[:, None]
    if window is not None:
        visible &= p[None, :] > p[:, None] - window
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


class PagedSeqs:
    """Sequences in a paged cache with shuffled block ids, fed to the backend in steps."""

    def __init__(self, lengths: list[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.q = [torch.randn(n, HEADS, DIM, generator=gen, dtype=torch.float64) for n in lengths]
        self.k = [torch.randn(n, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
                  for n in lengths]
        self.v = [torch.randn(n, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
                  for n in lengths]
        need = [-(-n // BLOCK) for n in lengths]
        ids = list(range(sum(need) + 3))
        random.Random(seed).shuffle(ids)
        self.table = torch.zeros(len(lengths), max(need), dtype=torch.int32)
        for i, n in enumerate(need):
            self.table[i, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
        self.cache = torch.full((2, len(ids) + sum(need), BLOCK, KV_HEADS, DIM), float("nan"),
                                dtype=torch.float64)

    def step(self, all_spans: list[tuple[int, int] | None], window, cap,
             scale) -> list[torch.Tensor | None]:
        """Request i computes positions all_spans[i] = (start, end) (None: not in this step):
        writes their K/V and attends."""
        live = [i for i, sp in enumerate(all_spans) if sp is not None]
        spans = [all_spans[i] for i in live]
        q_lens = [e - s for s, e in spans]
        qsl = np.zeros(len(spans) + 1, dtype=np.int32)
        qsl[1:] = np.cumsum(q_lens)
        seq = np.asarray([e for _, e in spans], dtype=np.int32)
        table = self.table[live]
        slots = [int(table[i, p // BLOCK]) * BLOCK + p % BLOCK
                 for i, (s, e) in enumerate(spans) for p in range(s, e)]
        meta = AttentionMetadata(
            num_actual_tokens=int(qsl[-1]), num_reqs=len(spans), max_query_len=max(q_lens),
            max_seq_len=int(seq.max()), query_start_loc=torch.from_numpy(qsl),
            seq_lens=torch.from_numpy(seq), block_table=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl,
            seq_lens_cpu=seq)
        cat = lambda xs: torch.cat([xs[i][s:e] for i, (s, e) in zip(live, spans)])  # noqa: E731
        impl = TorchAttention()
        impl.write_kv(cat(self.k), cat(self.v), self.cache, meta)
        out = torch.full((int(qsl[-1]), HEADS, DIM), float("nan"), dtype=torch.float64)
        impl.forward(cat(self.q), self.cache, meta, scale, out, sliding_window=window,
                     logits_soft_cap=cap)
        res: list[torch.Tensor | None] = [None] * len(all_spans)
        for j, i in enumerate(live):
            res[i] = out[qsl[j]:qsl[j + 1]]
        return res


LENGTHS = [37, 19, 64]
SCALE = DIM**-0.5
# Soft-cap 0.5 against scores of about +-3: most scores saturate, so an ignored cap shows.
CASES = [(5, None), (16, None), (1, None), (None, 0.5), (7, 0.5), (64, None)]


def _chunk_plan(length: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, length)) for s in range(0, length, chunk)]


@pytest.mark.parametrize("window,cap", CASES, ids=lambda x: str(x))
def test_torch_backend_matches_dense(window, cap):
    """Whole prompts, then the same sequences as chunked prefill (chunks of 7, like a prefix
    hit or a token budget) followed by one-token decode steps: every output row equals the
    dense attention of its position."""
    seqs = PagedSeqs(LENGTHS, seed=3)
    refs = [dense_attention(q, k, v, SCALE, window, cap)
            for q, k, v in zip(seqs.q, seqs.k, seqs.v)]
    whole = seqs.step([(0, n) for n in LENGTHS], window, cap, SCALE)
    for got, ref in zip(whole, refs):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)

    seqs = PagedSeqs(LENGTHS, seed=3)
    prefill = [n - 12 for n in LENGTHS]  # the last 12 positions of each are decode steps
    rows: list[list[torch.Tensor]] = [[] for _ in LENGTHS]
    plans = [_chunk_plan(p, 7) for p in prefill]
    for k in range(max(map(len, plans))):
        # Requests whose prompt is done sit out the step (batches of uneven membership).
        spans = [plan[k] if k < len(plan) else None for plan in plans]
        for i, o in enumerate(seqs.step(spans, window, cap, SCALE)):
            if o is not None:
                rows[i].append(o)
    for d in range(12):
        spans = [(p + d, p + d + 1) for p in prefill]
        for i, o in enumerate(seqs.step(spans, window, cap, SCALE)):
            rows[i].append(o)
    for i, ref in enumerate(refs):
        torch.testing.assert_close(torch.cat(rows[i]), ref, rtol=1e-10, atol=1e-10)


def test_window_and_cap_change_the_result():
    """The cases above would pass a backend that ignores the options only if the options had no
    effect here: they do. A window as long as the context is no window."""
    seqs = PagedSeqs([64], seed=3)
    q, k, v = seqs.q[0], seqs.k[0], seqs.v[0]
    full = dense_attention(q, k, v, SCALE, None, None)
    assert (dense_attention(q, k, v, SCALE, 16, None) - full).abs().max() > 1e-2
    assert (dense_attention(q, k, v, SCALE, None, 0.5) - full).abs().max() > 1e-2
    got = seqs.step([(0, 64)], 64, None, SCALE)[0]
    torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-10)


def test_attention_layer_passes_its_options():
    seen = {}

    class Recorder(TorchAttention):
        def forward(self, query, kv_cache, meta, scale, out, *, sliding_window=None,
                    logits_soft_cap=None):
            seen.update(window=sliding_window, cap=logits_soft_cap)
            out.zero_()

    layer = Attention(HEADS, DIM, KV_HEADS, SCALE, Recorder(), sliding_window=12,
                      logits_soft_cap=30.0)
    q = torch.zeros(3, HEADS * DIM)
    meta = AttentionMetadata(3, 1, 3, 3, torch.tensor([0, 3]), torch.tensor([3]),
                             torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1, 2]),
                             np.array([0, 3]), np.array([3]))
    layer.attend(q, meta)
    assert seen == {"window": 12, "cap": 30.0}
    with pytest.raises(ValueError, match="sliding_window"):
        Attention(HEADS, DIM, KV_HEADS, SCALE, TorchAttention(), sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        Attention(HEADS, DIM, KV_HEADS, SCALE, TorchAttention(), logits_soft_cap=-1.0)


# Which backend a windowed or soft-capped layer may run on is the kernel policy's rule:
# tests/worker/test_kernel_policy.py.


# --- tiny models against HF transformers -----------------------------------------------------

WINDOW = 16
NEW_TOKENS = 32
MODEL_PROMPTS = [60, 33, 90]  # all longer than the window, as is every generated position
LOGPROB_TOL = 2e-4  # float32 end to end: summation order only


def _hf_variant(folder, **overrides):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                attn_implementation="eager", **overrides).eval()


def _check_against_hf(folder, hf, other_hfs) -> None:
    from tidal.frontend import LLM, SamplingParams

    rng = random.Random(7)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in MODEL_PROMPTS]
    refs = [reference.hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    # The test means something only if attending differently changes the answer here.
    for other in other_hfs:
        assert any(reference.hf_greedy(other, p, NEW_TOKENS)[0] != r[0]
                   for p, r in zip(prompts, refs)), "the window does not change HF's tokens"
    # A token budget of 32 chunks every prompt; the second round hits the prefix cache, so its
    # prompts start from cached blocks. Both are prefill steps whose queries are the tail of
    # a context longer than the window.
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=128, max_num_seqs=4,
              max_num_batched_tokens=32, dtype="float32")
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                logprobs=0)
        for _ in range(2):
            outs = llm.generate(prompts, params, use_tqdm=False)
            for prompt, out, (ref_tokens, ref_lp) in zip(prompts, outs, refs):
                got = out.outputs[0]
                assert got.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens"
                ours = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
                assert max(abs(a - b) for a, b in zip(ours, ref_lp)) < LOGPROB_TOL
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_mistral_window_matches_hf(tmp_path):
    hf = reference.make_tiny_model("mistral", tmp_path, sliding_window=WINDOW,
                                   attn_implementation="eager")
    _check_against_hf(tmp_path, hf, [_hf_variant(tmp_path, sliding_window=None)])


@pytest.mark.slow
def test_qwen2_window_on_upper_layers_matches_hf(tmp_path):
    """Qwen2 windows only layers >= max_window_layers: layer 0 attends to everything."""
    hf = reference.make_tiny_model("qwen2", tmp_path, use_sliding_window=True,
                                   sliding_window=WINDOW, max_window_layers=1,
                                   attn_implementation="eager")
    assert hf.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    no_window = _hf_variant(tmp_path, use_sliding_window=False,
                            layer_types=["full_attention"] * 3)
    every_layer = _hf_variant(tmp_path, layer_types=["sliding_attention"] * 3)
    _check_against_hf(tmp_path, hf, [no_window, every_layer])


def test_arch_spec_windows_as_hf():
    from tidal.engine_core.model_arch import arch_from_hf_dict

    base = dict(reference.TINY_SHAPES, hidden_act="silu", num_hidden_layers=4)
    mistral = arch_from_hf_dict(dict(base, architectures=["MistralForCausalLM"],
                                     sliding_window=4096), "m")
    assert [mistral.layer_sliding_window(i) for i in range(4)] == [4096] * 4
    mistral = arch_from_hf_dict(dict(base, architectures=["MistralForCausalLM"],
                                     sliding_window=None), "m")
    assert [mistral.layer_sliding_window(i) for i in range(4)] == [None] * 4
    qwen = dict(base, architectures=["Qwen2ForCausalLM"], sliding_window=4096)
    assert arch_from_hf_dict(qwen, "q").sliding_window is None  # use_sliding_window off
    on = arch_from_hf_dict(dict(qwen, use_sliding_window=True, max_window_layers=2), "q")
    assert [on.layer_sliding_window(i) for i in range(4)] == [None, None, 4096, 4096]
    # HF's default max_window_layers (28) leaves a 4-layer model without a windowed layer.
    dflt = arch_from_hf_dict(dict(qwen, use_sliding_window=True), "q")
    assert [dflt.layer_sliding_window(i) for i in range(4)] == [None] * 4
    typed = arch_from_hf_dict(dict(qwen, use_sliding_window=True, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"]), "q")
    assert [typed.layer_sliding_window(i) for i in range(4)] == [4096, None, 4096, None]
