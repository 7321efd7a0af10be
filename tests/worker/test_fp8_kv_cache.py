"""FP8 KV cache (``--kv-cache-dtype fp8``) on the CPU: the torch attention path against a float64
computation of the stated semantics (K/V quantize-dequantized with the layer's scales, then
exact attention), the cache sizing (twice the blocks for the same memory), the checkpoint's
K/V scales, and tiny random Llama / Qwen3 models end to end against HF transformers whose KV
cache is fake-quantized here, independently.

The Triton kernels (write, prefill, decode, split decode) are compared with the torch
reference in ``test_fp8_kv_triton.py``; on a GPU the whole engine runs there too."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tidal.frontend import LLM, SamplingParams
from tidal.worker.attention.backend import AttentionMetadata
from tidal.worker.attention.fp8_kv import FP8_KV_DTYPE, load_kv_scale
from tidal.worker.attention.torch_backend import TorchAttention

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 17, 99, 3, 250, 41], [7] * 3 + list(range(20, 50)), [1, 2]]
BLOCK = 4


def fake_quant64(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The cache's round trip in float64, written from the definition: x / scale saturated to
    e4m3's +-448, rounded to e4m3, times scale."""
    q = (x.double() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.double() * scale


def attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q [q_len, H, D]`` (the last positions) over ``k, v [n, Hkv, D]``."""
    q_len, heads = q.shape[0], q.shape[1]
    n, kv_heads = k.shape[0], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(n - q_len, n)[:, None]
    s = s.masked_fill(torch.arange(n)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def _meta(q_lens: list[int], seq_lens: list[int], table: torch.Tensor,
          slots: torch.Tensor) -> AttentionMetadata:
    qsl = np.zeros(len(q_lens) + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(q_lens)
    seq = np.asarray(seq_lens, dtype=np.int32)
    return AttentionMetadata(
        num_actual_tokens=int(qsl[-1]), num_reqs=len(q_lens), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq), block_table=table, slot_mapping=slots,
        query_start_loc_cpu=qsl, seq_lens_cpu=seq,
        num_decodes=sum(1 for q in q_lens if q == 1))


def _slots(table: torch.Tensor, req: int, positions: range) -> list[int]:
    return [int(table[req, p // BLOCK]) * BLOCK + p % BLOCK for p in positions]


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_torch_attention_with_fp8_cache_matches_float64_semantics(kv_heads):
    gen = torch.Generator().manual_seed(kv_heads)
    heads, d = 4, 8
    q_lens, seq_lens = [1, 1, 5, 7], [9, 3, 11, 7]  # decodes, a prefill chunk, a whole prompt
    num_blocks = 24
    perm = torch.randperm(num_blocks, generator=gen)
    table = perm[: len(q_lens) * 4].reshape(len(q_lens), 4).to(torch.int32)
    cache = torch.zeros((2, num_blocks, BLOCK, kv_heads, d), dtype=FP8_KV_DTYPE)
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.005])
    impl = TorchAttention()
    keys = [torch.randn(n, kv_heads, d, generator=gen) * 3 for n in seq_lens]
    values = [torch.randn(n, kv_heads, d, generator=gen) for n in seq_lens]
    keys[0][2, 0, 1] = 50.0  # saturates at 448 * 0.02 = 8.96
    # The context before this step's queries, written by earlier steps.
    for i, (q, n) in enumerate(zip(q_lens, seq_lens)):
        if n > q:
            before = _meta([n - q], [n - q], table[i:i + 1],
                           torch.tensor(_slots(table, i, range(n - q))))
            impl.write_kv(keys[i][: n - q], values[i][: n - q], cache, before,
                          k_scale=k_scale, v_scale=v_scale)
    slots = torch.tensor(sum((_slots(table, i, range(n - q, n))
                              for i, (q, n) in enumerate(zip(q_lens, seq_lens))), []))
    meta = _meta(q_lens, seq_lens, table, slots)
    new_k = torch.cat([k[n - q:] for k, q, n in zip(keys, q_lens, seq_lens)])
    new_v = torch.cat([v[n - q:] for v, q, n in zip(values, q_lens, seq_lens)])
    impl.write_kv(new_k, new_v, cache, meta, k_scale=k_scale, v_scale=v_scale)
    query = torch.randn(sum(q_lens), heads, d, generator=gen)
    out = torch.full_like(query, float("nan"))
    scale = d**-0.5
    impl.forward(query, cache, meta, scale, out, k_scale=k_scale, v_scale=v_scale)

    start = 0
    for i, (q, n) in enumerate(zip(q_lens, seq_lens)):
        qi = query[start:start + q]
        ref = attention64(qi, fake_quant64(keys[i], 0.02), fake_quant64(values[i], 0.005), scale)
        torch.testing.assert_close(out[start:start + q].double(), ref, rtol=1e-5, atol=1e-5)
        # The quantization is real: exact attention over the unquantized K/V differs.
        plain = attention64(qi, keys[i].double(), values[i].double(), scale)
        assert (plain - ref).abs().max() > 1e-3
        start += q
    # Entries are stored as the definition says (the saturated one too).
    slot = int(table[0, 0]) * BLOCK + 2
    assert cache[0].view(-1, kv_heads, d)[slot, 0, 1].float() == 448.0


def _runner(folder, kv_cache_dtype: str, budget: int):
    from tidal.engine_core.config import EngineArgs
    from tidal.worker.model_runner import ModelRunner

    cfg = EngineArgs(model=str(folder), device="cpu", dtype="bfloat16",
                     kv_cache_memory_bytes=budget, kv_cache_dtype=kv_cache_dtype,
                     max_model_len=128).create_config()
    runner = ModelRunner(cfg, torch.device("cpu"))
    runner.load_model()
    return runner


def test_fp8_cache_holds_twice_the_blocks(tiny_models):
    folder, hf = tiny_models["llama"]
    budget = 3 << 20
    base, fp8 = _runner(folder, "auto", budget), _runner(folder, "fp8", budget)
    assert base.kv_bytes_per_block() == 2 * fp8.kv_bytes_per_block()
    n_base, n_fp8 = base.determine_num_blocks(), fp8.determine_num_blocks()
    assert n_base == budget // base.kv_bytes_per_block()
    assert n_fp8 == budget // fp8.kv_bytes_per_block()
    assert n_fp8 in (2 * n_base, 2 * n_base + 1)
    size = fp8.allocate_kv_cache(n_fp8)
    assert size <= budget and size == n_fp8 * fp8.kv_bytes_per_block()
    assert {c.dtype for c in fp8.kv_caches} == {FP8_KV_DTYPE}
    assert len(fp8.kv_caches) == hf.config.num_hidden_layers


def _scaled_copy(src, dst, hf, attn_prefix: str) -> dict[int, tuple[float, float]]:
    """A copy of the tiny checkpoint with per-layer K/V cache scales under
    ``...self_attn{attn_prefix}.k_scale``; returns them by layer."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = {}
    for f in dst.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
        f.unlink()
    scales = {}
    for i in range(hf.config.num_hidden_layers):
        # Distinct per layer and small enough that some large entries saturate.
        ks, vs = 0.004 * (i + 2), 0.003 * (i + 1)
        scales[i] = (ks, vs)
        base = f"model.layers.{i}.self_attn{attn_prefix}"
        tensors[f"{base}.k_scale"] = torch.tensor(ks)
        tensors[f"{base}.v_scale"] = torch.tensor([vs])
    save_file(tensors, str(dst / "model.safetensors"))
    return scales


class _FakeQuantCache:
    """A ``DynamicCache`` whose stored K/V go through the FP8 round trip with each layer's
    scales, so HF attends over what tidal's cache holds."""

    def __init__(self, scales: dict[int, tuple[float, float]]):
        from transformers import DynamicCache

        self.cache = DynamicCache()
        update = self.cache.update

        def quantized(k, v, layer_idx, *args, **kwargs):
            ks, vs = scales[layer_idx]
            return update(fake_quant64(k, ks).to(k.dtype), fake_quant64(v, vs).to(v.dtype),
                          layer_idx, *args, **kwargs)

        self.cache.update = quantized


@torch.no_grad()
def _hf_greedy_fp8(model, prompt, n, scales):
    past = _FakeQuantCache(scales).cache
    out = model(torch.tensor([prompt]), past_key_values=past, use_cache=True)
    tokens, logprobs = [], []
    for _ in range(n):
        lp = out.logits[0, -1].float().log_softmax(-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
    return tokens, logprobs


def _run(folder, **kw):
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=64, device="cpu",
              cpu_threads=1, **kw)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    return ([o.outputs[0].token_ids for o in outs],
            [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
             for o in outs])


def _max_diff(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("family,prefix", [("llama", ""), ("qwen3", ".attn")])
def test_fp8_kv_greedy_matches_fake_quantized_hf(tiny_models, tmp_path, family, prefix):
    folder, hf = tiny_models[family]
    dst = tmp_path / "scaled"
    scales = _scaled_copy(folder, dst, hf, prefix)
    tokens, logprobs = _run(dst, kv_cache_dtype="fp8")
    refs = [_hf_greedy_fp8(hf, p, PARAMS.max_tokens, scales) for p in PROMPTS]
    assert tokens == [r[0] for r in refs]
    assert _max_diff(logprobs, [r[1] for r in refs]) < 2e-3
    # The cache really is FP8: the same checkpoint with a model-dtype cache differs.
    _, plain = _run(dst)
    assert _max_diff(logprobs, plain) > 1e-4


def test_checkpoint_scales_load_into_their_layers(tiny_models, tmp_path):
    from tidal.engine_core.config import EngineArgs
    from tidal.worker.loader.model_loader import load_model

    folder, hf = tiny_models["llama"]
    dst = tmp_path / "scaled"
    scales = _scaled_copy(folder, dst, hf, "")
    cfg = EngineArgs(model=str(dst), device="cpu", num_kv_blocks=64,
                     kv_cache_dtype="fp8").create_config()
    model = load_model(cfg.model, torch.device("cpu"), TorchAttention())
    for i, (ks, vs) in scales.items():
        attn = model.layers[str(i)].self_attn.attn
        assert attn.k_scale.dtype == torch.float32
        assert float(attn.k_scale) == pytest.approx(ks)
        assert float(attn.v_scale) == pytest.approx(vs)
    # Per-head scales and non-positive ones are refused, naming the tensor.
    with pytest.raises(ValueError, match="per-head scales"):
        load_kv_scale(model, "layers.0.self_attn.k_scale", torch.ones(2))
    with pytest.raises(ValueError, match="finite and > 0"):
        load_kv_scale(model, "layers.0.self_attn.attn.v_scale", torch.tensor(0.0))
    assert not load_kv_scale(model, "layers.0.self_attn.k_proj.weight", torch.ones(1))
