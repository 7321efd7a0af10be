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
    # For smoke runs on a CPU: the Qwen3 layout, shrunk.
    "tiny": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 2048,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "eos_token_id": 0,
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
    """Byte and FLOP counts of one shape (bf16), as docs/BENCHMARKS.md defines them."""

    num_layers: int
    hidden: int
    vocab: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_params: int  # per-token matmul weights of all layers (q/k/v/o, gate/up/down)
    nonembedding_params: int  # linear + norms
    dtype_bytes: int = 2
    sliding_window: int | None = None  # the local layers read at most this many tokens
    num_local_layers: int = 0

    @property
    def weight_bytes_per_step(self) -> int:
        """2·(N_nonembedding + V·h): every layer's weights and the LM head, read once."""
        return self.dtype_bytes * (self.nonembedding_params + self.vocab * self.hidden)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def decode_bytes(self, contexts_total: int) -> int:
        return self.weight_bytes_per_step + contexts_total * self.kv_bytes_per_token

    def decode_bytes_batch(self, batch: int, context: float) -> int:
        """Like ``decode_bytes`` for ``batch`` requests of ``context`` tokens each, where the
        sliding-window layers read only their window."""
        if not self.num_local_layers or self.sliding_window is None:
            return self.decode_bytes(int(batch * context))
        per_layer_token = self.kv_bytes_per_token // self.num_layers
        local, full = self.num_local_layers, self.num_layers - self.num_local_layers
        per_request = per_layer_token * (full * context
                                         + local * min(context, self.sliding_window))
        return self.weight_bytes_per_step + int(batch * per_request)

    def prefill_flops(self, prompt_lens: list[int], sampled_rows: int) -> float:
        """Matmul FLOPs of a prefill: 2·params per token, causal attention (QK^T and PV over
        the lower triangle), the LM head on the sampled rows."""
        tokens = sum(prompt_lens)
        linear = 2.0 * self.linear_params * tokens
        pairs = sum(n * (n + 1) / 2 for n in prompt_lens)
        attn = 4.0 * self.num_layers * self.num_heads * self.head_dim * pairs
        head = 2.0 * self.vocab * self.hidden * sampled_rows
        return linear + attn + head


def shape_facts(shape: str) -> ShapeFacts:
    c = SHAPES[shape]
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
