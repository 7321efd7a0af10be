"""A BERT encoder for sentence embeddings (all-MiniLM-L6-v2 and other ``BertModel`` checkpoints):
bidirectional attention over the whole prompt, then mean pooling over the real tokens and L2
normalisation, as sentence-transformers does.

Parameter names follow HF transformers' ``BertModel`` except the fused ``qkv`` projection, which
``load_weights`` assembles from the checkpoint's separate query/key/value tensors. The pooler
head (``pooler.*``) and masked-LM heads (``cls.*``) are not used by mean pooling and are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tidal.engine_core.model_arch import ArchSpec

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class BertWeightError(ValueError):
    def __init__(self, tensor: str, message: str) -> None:
        super().__init__(f"tensor {tensor!r}: {message}")
        self.tensor = tensor


class BertEmbeddings(nn.Module):
    def __init__(self, arch: ArchSpec, dtype: torch.dtype) -> None:
        super().__init__()
        h = arch.hidden_size
        self.word_embeddings = nn.Embedding(arch.vocab_size, h, dtype=dtype)
        self.position_embeddings = nn.Embedding(arch.max_position_embeddings, h, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(max(arch.type_vocab_size, 1), h, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(h, eps=arch.layer_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # Single-segment input: every token has type 0.
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
             + self.token_type_embeddings.weight[0])
        return self.LayerNorm(x)


class BertLayer(nn.Module):
    def __init__(self, arch: ArchSpec, dtype: torch.dtype) -> None:
        super().__init__()
        h = arch.hidden_size
        self.num_heads = arch.num_heads
        self.head_dim = arch.head_dim
        self.qkv = nn.Linear(h, 3 * h, dtype=dtype)
        self.attn_out = nn.Linear(h, h, dtype=dtype)
        self.attn_norm = nn.LayerNorm(h, eps=arch.layer_norm_eps, dtype=dtype)
        self.intermediate = nn.Linear(h, arch.intermediate_size, dtype=dtype)
        self.output = nn.Linear(arch.intermediate_size, h, dtype=dtype)
        self.output_norm = nn.LayerNorm(h, eps=arch.layer_norm_eps, dtype=dtype)
        act = _ACTIVATIONS.get(arch.hidden_act)
        if act is None:
            raise ValueError(f"unsupported BERT activation {arch.hidden_act!r}; tidal supports "
                             f"{', '.join(sorted(_ACTIVATIONS))}")
        self.act = act

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), attn_mask=key_mask)
        x = self.attn_norm(x + self.attn_out(attn.transpose(1, 2).reshape(b, t, h)))
        return self.output_norm(x + self.output(self.act(self.intermediate(x))))


class BertEmbeddingModel(nn.Module):
    """``forward(input_ids [B, T], lengths [B]) -> [B, H]`` float32 unit vectors; rows are
    right-padded, and positions at or past a row's length are ignored."""

    # checkpoint suffix -> (our module suffix, shard of the fused qkv or None)
    _RENAMES = (
        (".attention.self.query.", ".qkv.", 0),
        (".attention.self.key.", ".qkv.", 1),
        (".attention.self.value.", ".qkv.", 2),
        (".attention.output.dense.", ".attn_out.", None),
        (".attention.output.LayerNorm.", ".attn_norm.", None),
        (".intermediate.dense.", ".intermediate.", None),
        (".output.dense.", ".output.", None),
        (".output.LayerNorm.", ".output_norm.", None),
    )

    def __init__(self, arch: ArchSpec, dtype: torch.dtype, impl: object = None,
                 tp: object = None, pp: object = None) -> None:
        # ``impl``/``tp``/``pp`` complete the registry's constructor signature: an encoder has
        # no KV cache and runs unsharded, so a real split is refused rather than ignored.
        for group in (tp, pp):
            if getattr(group, "world_size", 1) > 1:
                raise ValueError(f"{arch.architecture} does not support tensor or pipeline "
                                 "parallelism")
        super().__init__()
        self.arch = arch
        self.embeddings = BertEmbeddings(arch, dtype)
        self.layers = nn.ModuleList(BertLayer(arch, dtype) for _ in range(arch.num_layers))

    def attention_layers(self) -> list[nn.Module]:
        return []  # no KV cache: every prompt is encoded whole, in one step

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        valid = torch.arange(t, device=input_ids.device)[None, :] < lengths[:, None]  # [B, T]
        key_mask = valid[:, None, None, :]  # broadcast over heads and query positions
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, key_mask)
        weights = valid.to(x.dtype).unsqueeze(-1)
        pooled = (x * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return F.normalize(pooled.float(), p=2, dim=-1)

    # --- weights ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF ``BertModel`` tensors into the parameters; raises ``BertWeightError`` naming
        the tensor on a mismatch, and listing every parameter the checkpoint lacked."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        qkv_parts: dict[str, set[int]] = {}
        h = self.arch.hidden_size
        for ckpt_name, tensor in weights:
            mapped = self._param_name(ckpt_name)
            if mapped is None:
                continue
            name, shard = mapped
            param = params.get(name)
            if param is None:
                raise BertWeightError(ckpt_name, "the checkpoint has it but the model does not; "
                                      "is this a BertModel checkpoint?")
            target = param.data if shard is None else param.data[shard * h:(shard + 1) * h]
            if tuple(target.shape) != tuple(tensor.shape):
                raise BertWeightError(ckpt_name, f"shape {tuple(tensor.shape)} does not match "
                                      f"the model's {tuple(target.shape)} (config.json wrong?)")
            with torch.no_grad():
                target.copy_(tensor.to(target.dtype))
            if shard is None:
                loaded.add(name)
            else:
                qkv_parts.setdefault(name, set()).add(shard)
        loaded.update(name for name, parts in qkv_parts.items() if parts == {0, 1, 2})
        missing = sorted(set(params) - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise BertWeightError(missing[0], f"missing from the checkpoint ({len(missing)} "
                                  f"parameters not loaded: {shown})")

    def _param_name(self, ckpt_name: str) -> tuple[str, int | None] | None:
        name = ckpt_name.removeprefix("bert.")
        if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
            return None
        # Checkpoints from old TensorFlow conversions call LayerNorm's parameters gamma/beta.
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
            "LayerNorm.beta", "LayerNorm.bias")
        if name.startswith("embeddings."):
            return name, None
        if not name.startswith("encoder.layer."):
            return name, None  # reported as unknown by the caller
        name = "layers." + name[len("encoder.layer."):]
        for old, new, shard in self._RENAMES:
            if old in name:
                return name.replace(old, new), shard
        return name, None
