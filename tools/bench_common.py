"""Shared pieces of tidal's benchmarks: model shapes (dummy weights), the ceilings measured in the
same run, roofline arithmetic (docs/BENCHMARKS.md), and small statistics helpers.

Shapes are HF ``config.json`` files written into a temporary folder; ``load_format="dummy"`` then
builds the model with random weights, so no checkpoint is needed.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "eos_token_id": 151645,
        "bos_token_id": 151643, "hidden_act": "silu", "attention_bias": False,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 128001,
        "bos_token_id": 128000, "hidden_act": "silu",
    },
    # The sliding-window families of issue 19 (HF configs of the released checkpoints).
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000,
        "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "max_position_embeddings": 8192, "sliding_window": 4096, "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
        "torch_dtype": "bfloat16", "eos_token_id": 1, "bos_token_id": 2,
        "tie_word_embeddings": True,
    },
    "gemma-3-12b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "max_position_embeddings": 131072, "sliding_window": 1024,
        "query_pre_attn_scalar": 256, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "bfloat16",
        "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
    },
    # The mixture-of-experts shapes of issue 22 (HF configs of the released checkpoints).
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": None, "sliding_window": None, "use_sliding_window": False,
        "max_window_layers": 48, "attention_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "eos_token_id": 151645, "bos_token_id": 151643,
        "hidden_act": "silu",
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "eos_token_id": 2, "bos_token_id": 1, "hidden_act": "silu",
    },
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1,
        "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "scoring_func": "softmax", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707},
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eos_token_id": 100001, "bos_token_id": 100000, "hidden_act": "silu",
    },
    # DeepSeek-V2-Lite's sizes under DeepSeek-V3's routing (sigmoid + bias, noaux_tc over 8
    # groups) with one multi-token-prediction layer: the ``mtp`` method's dummy target.
    "deepseek-v3-lite-mtp": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "num_nextn_predict_layers": 1, "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0},
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eos_token_id": 1, "bos_token_id": 0, "hidden_act": "silu",
    },
    # For CPU smoke runs of ``mtp``: the layout above, shrunk.
    "tiny-deepseek-v3-mtp": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 1,
        "hidden_act": "silu",
    },
    # For smoke runs on a CPU: the Qwen3 layout, shrunk.
    "tiny": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 2048,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "eos_token_id": 0,
    },
    # The Qwen3-MoE layout, shrunk (CPU smoke runs of the MoE accounting).
    "tiny-moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 2048,
        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 0,
    },
}


def write_model_dir(shape: str, folder: Path, tokenizer: str | None = None) -> str:
    """A folder with the shape's config.json (and the tokenizer files, if given)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHAPES[shape]))
    if tokenizer:
        import gzip
        import shutil

        src = Path(tokenizer)
        for f in src.iterdir():
            if f.name.endswith(".gz"):
                with gzip.open(f, "rb") as a, open(folder / f.name[:-3], "wb") as b:
                    shutil.copyfileobj(a, b)
            elif f.is_file():
                shutil.copy(f, folder / f.name)
    return str(folder)


@dataclass(frozen=True, slots=True)
class ShapeFacts:
    """Byte and FLOP counts of one shape (bf16), as docs/BENCHMARKS.md defines them.

    Mixture of experts: a decode step reads every weight but the routed experts' once, plus the
    experts its tokens are routed to: exactly ``experts_per_tok`` per MoE layer at batch 1, and
    at batch B the expected number of distinct experts under uniform routing (each token picks
    k of E experts uniformly at random, independently of the other tokens), E·(1 − (1 − k/E)^B)
    per layer. Real routers are skewed, so they touch fewer experts than this at mid batches:
    the figure is the bytes a balanced load reads, an upper bound on a trained model's.
    Prefill FLOPs count the active parameters only (router, shared experts, top-k experts).
    MLA (DeepSeek-V2): the cache holds ``kv_cache_dim`` values per token per layer (the
    compressed latent and the shared rope key) instead of 2·n_kv·d_head.
    """

    num_layers: int
    hidden: int
    vocab: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # MLA: qk_nope_head_dim, the d_h of a head were the model MHA
    # Per-token matmul weights of all layers (q/k/v/o, gate/up/down; MoE: the router, the
    # shared experts and experts_per_tok routed experts, i.e. the active parameters).
    linear_params: int
    nonembedding_params: int  # every weight but the embeddings (all experts) + norms
    dtype_bytes: int = 2
    sliding_window: int | None = None  # the local layers read at most this many tokens
    num_local_layers: int = 0
    num_moe_layers: int = 0
    num_experts: int = 0  # routed experts of a MoE layer (0: dense)
    experts_per_tok: int = 0
    expert_params: int = 0  # one routed expert's gate + up + down
    kv_cache_dim: int = 0  # values cached per token per layer (0: 2·n_kv·d_head)
    qk_head_dim: int = 0  # attention FLOPs' per-head dims (0: head_dim)
    v_head_dim: int = 0

    @property
    def weight_bytes_per_step(self) -> int:
        """2·(N_nonembedding + V·h): every layer's weights (MoE: all experts) and the LM head,
        read once."""
        return self.dtype_bytes * (self.nonembedding_params + self.vocab * self.hidden)

    def experts_touched(self, batch: int) -> float:
        """Expected distinct routed experts one MoE layer reads for ``batch`` tokens under
        uniform routing (exactly ``experts_per_tok`` for one token)."""
        if not self.num_experts or batch <= 0:
            return 0.0
        if batch == 1:
            return float(self.experts_per_tok)
        e, k = self.num_experts, self.experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** batch)

    def weight_bytes_batch(self, batch: int) -> int:
        """Weight bytes a decode step of ``batch`` tokens reads: ``weight_bytes_per_step`` less
        the routed experts no token is expected to touch."""
        if not self.num_experts:
            return self.weight_bytes_per_step
        untouched = self.num_experts - self.experts_touched(batch)
        skipped = self.num_moe_layers * untouched * self.expert_params * self.dtype_bytes
        return int(round(self.weight_bytes_per_step - skipped))

    @property
    def kv_bytes_per_token(self) -> int:
        if self.kv_cache_dim:
            return self.num_layers * self.kv_cache_dim * self.dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def mha_kv_bytes_per_token(self) -> int:
        """The cache of the same model with plain multi-head attention: K and V of
        ``num_heads`` heads of ``head_dim`` per layer (the MLA comparison of DeepSeek-V2)."""
        return 2 * self.num_layers * self.num_heads * self.head_dim * self.dtype_bytes

    def decode_bytes(self, contexts_total: int) -> int:
        return self.weight_bytes_per_step + contexts_total * self.kv_bytes_per_token

    def decode_bytes_batch(self, batch: int, context: float) -> int:
        """Bytes of one decode step of ``batch`` requests of ``context`` tokens each: the
        weights the batch reads (``weight_bytes_batch``) and every request's KV, where the
        sliding-window layers read only their window."""
        weights = self.weight_bytes_batch(batch)
        if not self.num_local_layers or self.sliding_window is None:
            return weights + int(batch * context) * self.kv_bytes_per_token
        per_layer_token = self.kv_bytes_per_token // self.num_layers
        local, full = self.num_local_layers, self.num_layers - self.num_local_layers
        per_request = per_layer_token * (full * context
                                         + local * min(context, self.sliding_window))
        return weights + int(batch * per_request)

    def prefill_flops(self, prompt_lens: list[int], sampled_rows: int) -> float:
        """Matmul FLOPs of a prefill: 2·active params per token, causal attention (QK^T and PV
        over the lower triangle; MLA expanded, as its prefill runs), the LM head on the
        sampled rows."""
        tokens = sum(prompt_lens)
        linear = 2.0 * self.linear_params * tokens
        pairs = sum(n * (n + 1) / 2 for n in prompt_lens)
        dqk, dv = self.qk_head_dim or self.head_dim, self.v_head_dim or self.head_dim
        attn = 2.0 * self.num_layers * self.num_heads * (dqk + dv) * pairs
        head = 2.0 * self.vocab * self.hidden * sampled_rows
        return linear + attn + head


def shape_facts(shape: str) -> ShapeFacts:
    return config_facts(SHAPES[shape], shape)


def config_facts(c: dict[str, Any], name: str = "config") -> ShapeFacts:
    """The :class:`ShapeFacts` of an HF config dict (MoE and MLA shapes through
    :func:`sparse_facts`)."""
    if any(c.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts",
                              "kv_lora_rank")):
        return sparse_facts(c, name)
    h, L = c["hidden_size"], c["num_hidden_layers"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or h // nh
    ffn = c["intermediate_size"]
    per_layer = h * (nh + 2 * nkv) * d + nh * d * h + 2 * h * ffn + ffn * h
    norms = L * 2 * h + h + (2 * L * d if c["model_type"] == "qwen3" else 0)
    linear = L * per_layer
    window = c.get("sliding_window")
    local = 0
    if window and c["model_type"] == "gemma2":
        local = L // 2  # even layers are local
    elif window and c["model_type"] == "gemma3_text":
        local = L - L // c.get("sliding_window_pattern", 6)  # every sixth layer is global
    elif window:
        local = L
    return ShapeFacts(L, h, c["vocab_size"], nh, nkv, d, linear, linear + norms,
                      sliding_window=window, num_local_layers=local)


def sparse_facts(c: dict[str, Any], name: str = "config") -> ShapeFacts:
    """:class:`ShapeFacts` of a mixture-of-experts and/or MLA config, read through tidal's own
    normaliser so the MoE layers, shared experts and latent sizes are the ones the engine
    builds."""
    from tidal.engine_core.model_arch import arch_from_hf_dict

    a = arch_from_hf_dict(c, name)
    h, L, nh = a.hidden_size, a.num_layers, a.num_heads
    if a.is_mla:
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = h * nh * qk if a.q_lora_rank is None else h * a.q_lora_rank + a.q_lora_rank * nh * qk
        kv_dim = a.kv_lora_rank + a.qk_rope_head_dim
        attn = (q + h * kv_dim + a.kv_lora_rank * nh * (a.qk_nope_head_dim + a.v_head_dim)
                + nh * a.v_head_dim * h)
        attn_norms = a.kv_lora_rank + (a.q_lora_rank or 0)  # kv_a / q_a layernorms
        head_dim, nkv, dqk, dv = a.qk_nope_head_dim, nh, qk, a.v_head_dim
    else:
        head_dim, nkv = a.head_dim, a.num_kv_heads
        attn = h * (nh + 2 * nkv) * head_dim + nh * head_dim * h
        attn_norms = 2 * head_dim if a.qk_norm else 0
        kv_dim = dqk = dv = 0
    experts, k = a.num_experts, a.num_experts_per_tok
    expert = 3 * h * a.moe_intermediate_size
    shared = 3 * h * (a.shared_expert_intermediate_size
                      or a.n_shared_experts * a.moe_intermediate_size)
    n_moe = sum(1 for i in range(L) if a.is_moe_layer(i))
    active = (L * attn + (L - n_moe) * 3 * h * a.intermediate_size
              + n_moe * (h * experts + shared + k * expert))
    all_linear = active + n_moe * (experts - k) * expert
    norms = L * (2 * h + attn_norms) + h
    local = 0
    if a.sliding_window:
        local = sum(1 for i in range(L) if a.layer_sliding_window(i) is not None)
    return ShapeFacts(L, h, a.vocab_size, nh, nkv, head_dim, active, all_linear + norms,
                      sliding_window=a.sliding_window, num_local_layers=local,
                      num_moe_layers=n_moe, num_experts=experts, experts_per_tok=k,
                      expert_params=expert, kv_cache_dim=kv_dim, qk_head_dim=dqk,
                      v_head_dim=dv)


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def time_cuda(fn, reps: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def measure_ceilings() -> dict[str, Any]:
    """HBM bandwidth (2 GiB device-to-device copy, bytes read + written) and the bf16 matmul
    peak (8192³ on random data), medians of 10 timed runs after 3 warm-ups."""
    if not torch.cuda.is_available():
        return {"hbm_GBps": None, "matmul_TFLOPs": None}
    n = 1 << 30  # bf16 elements: 2 GiB
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src), 10)
    bw = 2 * src.numel() * 2 / statistics.median(t) / 1e9
    del src, dst
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    t2 = time_cuda(lambda: a @ b, 10)
    flops = 2 * m**3 / statistics.median(t2) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return {"hbm_GBps": round(bw, 1), "hbm_copy_ms": [round(x * 1e3, 4) for x in t],
            "matmul_TFLOPs": round(flops, 1), "matmul_ms": [round(x * 1e3, 4) for x in t2]}


def summary(values: list[float], digits: int = 4) -> dict[str, float]:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "n": len(values)}


def now() -> float:
    return time.perf_counter()


def dump(result: dict[str, Any], out: str | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text)


def judge(targets: dict[str, tuple[str, float, str]],
          values: dict[str, float | None]) -> dict[str, dict[str, Any]]:
    """Each target ``name -> (op "<=" or ">=", bound, what)`` with its measured value and a
    PASS / MISS verdict (n/a where nothing was measured)."""
    out: dict[str, dict[str, Any]] = {}
    for name, (op, bound, what) in targets.items():
        v = values[name]
        if v is None:
            verdict = "n/a"
        else:
            verdict = "PASS" if (v <= bound if op == "<=" else v >= bound) else "MISS"
        out[name] = {"what": what, "value": v, "target": f"{op} {bound}", "verdict": verdict}
    return out
