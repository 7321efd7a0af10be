"""Writes AWQ- and GPTQ-format INT4 checkpoints of a model by plain round-to-nearest, for the
INT4 tests. The packing here follows the published formats and is written independently of
``tidal.worker.ops.int4_torch`` (so a shared misreading would not cancel out):

- AWQ "gemm": ``qweight`` int32 [K, N / 8], nibble ``i`` of word ``[k, c]`` holding output
  column ``8 c + (0, 2, 4, 6, 1, 3, 5, 7)[i]``; ``qzeros`` int32 [G, N / 8] packed the same;
  ``scales`` fp16 [G, N].
- GPTQ: ``qweight`` int32 [K / 8, N], nibble ``i`` of word ``[r, n]`` holding input channel
  ``8 r + i``; ``qzeros`` int32 [G, N / 8], sequential along N, each zero stored minus one in
  the classic format (``checkpoint_format`` "gptq"); ``scales`` fp16 [G, N]; ``g_idx`` int32
  [K], the group of each input channel.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_NIBBLE_COLUMNS = (0, 2, 4, 6, 1, 3, 5, 7)


def _words(nibbles: np.ndarray) -> np.ndarray:
    """``nibbles`` [..., 8] (0..15), nibble i at bits 4 i: int32 words [...]."""
    acc = np.zeros(nibbles.shape[:-1], dtype=np.uint64)
    for i in range(8):
        acc |= nibbles[..., i].astype(np.uint64) << np.uint64(4 * i)
    return acc.astype(np.uint32).view(np.int32)


def pack_awq(values: np.ndarray) -> np.ndarray:
    """[R, C] -> [R, C / 8], AWQ's column order within each word."""
    r, c = values.shape
    v = values.reshape(r, c // 8, 8)[..., list(AWQ_NIBBLE_COLUMNS)]
    return _words(v)


def pack_sequential(values: np.ndarray, axis: int) -> np.ndarray:
    """Eight consecutive entries along ``axis`` into one word."""
    v = np.moveaxis(values, axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    return np.moveaxis(_words(v), -1, axis)


def group_params(cols: torch.Tensor, sym: bool, min_zero: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale [N], zero [N])`` of one group ``cols`` [N, g] (float64): the scale rounded to
    fp16 as the checkpoint holds it, zero points at least ``min_zero``."""
    n = cols.shape[0]
    if sym:
        amax = cols.abs().amax(1).clamp_min(1e-8)
        s, z = 2 * amax / 15, torch.full((n,), 8.0, dtype=torch.float64)
    else:  # the range always holds 0 (AWQ's and GPTQ's own quantizers)
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        s = ((hi - lo) / 15).clamp_min(1e-8)
        z = (-lo / s).round().clamp(min_zero, 15)
    return s.half().double(), z


def rtn(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool, min_zero: int = 0
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest INT4 of ``w`` [N, K] (float64) by input-channel group ``g_idx``:
    ``(q [N, K], zeros [N, G], scales fp16 [N, G])``; zero points at least ``min_zero``."""
    n, _ = w.shape
    scales = torch.empty(n, groups, dtype=torch.float64)
    zeros = torch.empty(n, groups, dtype=torch.float64)
    for g in range(groups):
        scales[:, g], zeros[:, g] = group_params(w[:, g_idx == g], sym, min_zero)
    gi = g_idx.long()
    q = (w / scales[:, gi] + zeros[:, gi]).round().clamp(0, 15)
    return q.long(), zeros.long(), scales.half()


def dequantized(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor) -> torch.Tensor:
    gi = g_idx.long()
    return (q - zeros[:, gi]).double() * scales.double()[:, gi]


def write_int4_checkpoint(src: Path, dst: Path, hf, method: str, group_size: int = 128,
                          act_order: bool = False, sym: bool = False, v2: bool = False,
                          seed: int = 0, dequantize: bool = True) -> dict[str, torch.Tensor]:
    """An AWQ or GPTQ copy of the HF safetensors model in ``src`` (``hf`` its loaded model, or
    its state dict, which is quantized) into ``dst``; returns the dequantized weight [N, K]
    (float64) of each quantized linear by checkpoint name, for a reference model.
    ``act_order``: GPTQ with a random ``g_idx`` shared by the linears that read the same
    input (q/k/v, gate/up), as GPTQ's own act-order gives them. ``dequantize=False``: no
    reference weights (an empty dict; float64 copies of a real model's weights cost seconds)."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    gen = torch.Generator().manual_seed(seed)
    cfg = json.loads((dst / "config.json").read_text())
    state = hf if isinstance(hf, dict) else hf.state_dict()
    perms: dict[str, torch.Tensor] = {}
    tensors, deq = {}, {}
    for name, t in state.items():
        module = name.rsplit(".", 1)[0]
        proj = module.split(".")[-1]
        if not (name.endswith(".weight") and proj in LINEARS):
            if not (name == "lm_head.weight" and cfg.get("tie_word_embeddings")):
                tensors[name] = t.contiguous()
            continue
        w = t.double()
        n, k = w.shape
        g = k if group_size == -1 else group_size
        groups = -(-k // g)
        g_idx = torch.arange(k) // g
        if act_order:
            key = module.rsplit(".", 1)[0] + {"q_proj": "qkv", "k_proj": "qkv",
                                              "v_proj": "qkv", "gate_proj": "gu",
                                              "up_proj": "gu"}.get(proj, proj)
            if key not in perms:
                perms[key] = torch.randperm(k, generator=gen)
            g_idx = g_idx[perms[key]]
        # (The classic GPTQ format cannot store a zero point of 0: it would read back as 16.)
        q, zeros, scales = rtn(w, g_idx, groups, sym, 1 if method == "gptq" and not v2 else 0)
        if dequantize:
            deq[name] = dequantized(q, zeros, scales, g_idx)
        qt, zt = q.t().numpy(), zeros.t().numpy()  # [K, N], [G, N]
        if method == "awq":
            tensors[module + ".qweight"] = torch.from_numpy(pack_awq(qt))
            tensors[module + ".qzeros"] = torch.from_numpy(pack_awq(zt))
        else:
            tensors[module + ".qweight"] = torch.from_numpy(pack_sequential(qt, 0))
            stored = zt if v2 else (zt - 1) & 0xF  # (a zero of 0 wraps, as in GPTQ)
            tensors[module + ".qzeros"] = torch.from_numpy(pack_sequential(stored, 1))
            tensors[module + ".g_idx"] = g_idx.to(torch.int32)
        tensors[module + ".scales"] = scales.t().contiguous()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    if method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
              "version": "gemm"}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
              "desc_act": act_order, "sym": sym,
              "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return deq


def dequantized_hf(hf, deq: dict[str, torch.Tensor]):
    """A copy of ``hf`` whose quantized linears hold the dequantized weights."""
    import copy

    model = copy.deepcopy(hf)
    state = model.state_dict()
    with torch.no_grad():
        for name, w in deq.items():
            state[name].copy_(w.to(state[name].dtype))
    return model
