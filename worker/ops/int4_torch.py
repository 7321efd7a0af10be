"""INT4 weight-only (W4A16) linear in plain torch: the reference every other INT4 path is tested
against, and what CPU workers run; plus the conversions of AWQ / GPTQ checkpoint tensors into
tidal's one INT4 layout.

tidal's layout (the same for AWQ and GPTQ, made once as the checkpoint loads):

- ``qweight`` int32 [N, K / 8]: output rows, each the row's K 4-bit values packed eight to an
  int32 along the input dim, value ``k`` in bits ``4 * (k % 8)`` of word ``k // 8`` (GPTQ's
  order, transposed). Rows first, so column-parallel shards and fused q/k/v or gate/up parts
  are row ranges, exactly as for a 16-bit weight [N, K], and a row-parallel shard is a column
  range of whole words.
- ``scales`` [N, G] in the model dtype and ``qzeros`` uint8 [N, G]: the scale and zero point of
  each output row's G = ceil(K / group_size) groups of input channels, unpacked.
- ``g_idx`` int32 [K] or None: GPTQ act-order's group of each input channel (None: channel
  ``k`` is in group ``k // group_size``). Carried into the kernels rather than permuting the
  input channels at load, so a row-parallel rank needs no permutation of its activations.

``w = (q - z) * s`` elementwise, dequantized to the activation dtype, then ``x @ w.T``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK = 8  # 4-bit values per int32
# AWQ packs output columns [0..7] of each word into nibbles in this order: nibble i holds column
# AWQ_ORDER[i] (AutoAWQ's "gemm" format).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SEQUENTIAL = tuple(range(PACK))


def unpack(packed: torch.Tensor, dim: int, order: tuple[int, ...] = _SEQUENTIAL
           ) -> torch.Tensor:
    """The 4-bit values (int32, 0..15) of the int32 ``packed``, eight per word along ``dim``:
    element ``8 * j + order[i]`` of ``dim`` is nibble ``i`` of word ``j``."""
    p = packed.to(torch.int32).movedim(dim, -1)
    # Value c of each word sits in nibble order.index(c).
    shifts = torch.tensor([4 * order.index(c) for c in range(PACK)], dtype=torch.int32,
                          device=p.device)
    values = ((p.unsqueeze(-1) >> shifts) & 0xF).reshape(*p.shape[:-1], p.shape[-1] * PACK)
    return values.movedim(-1, dim)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """``values`` [N, K] (0..15, K a multiple of 8) packed along K into int32 [N, K / 8]
    (tidal's and GPTQ's sequential order)."""
    n, k = values.shape
    if k % PACK:
        raise ValueError(f"{k} input channels are not a multiple of {PACK}")
    v = values.to(torch.int64).reshape(n, k // PACK, PACK)
    word = torch.zeros(n, k // PACK, dtype=torch.int64, device=values.device)
    for i in range(PACK):
        word |= v[..., i] << (4 * i)
    # The same 32 bits as a signed int32 (a top nibble of 8 or more makes it negative).
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def awq_qweight(t: torch.Tensor) -> torch.Tensor:
    """AWQ ``qweight`` [K, N / 8] (packed along N, AWQ's order) in tidal's layout [N, K / 8]."""
    return pack_rows(unpack(t, 1, AWQ_ORDER).t())


def gptq_qweight(t: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qweight`` [K / 8, N] (packed along K, sequential) in tidal's layout [N, K / 8]:
    the same words, transposed."""
    return t.to(torch.int32).t().contiguous()


def zeros_of(t: torch.Tensor, awq: bool, minus_one: bool) -> torch.Tensor:
    """A checkpoint's ``qzeros`` [G, N / 8] as zero points uint8 [N, G]; the classic GPTQ
    format stores each minus one (``minus_one``), so 16 is possible, as GPTQ's kernels read
    it."""
    z = unpack(t, 1, AWQ_ORDER if awq else _SEQUENTIAL)
    if minus_one:
        z = z + 1
    return z.t().to(torch.uint8).contiguous()


def group_index(k: int, group_size: int, g_idx: torch.Tensor | None,
                device: torch.device) -> torch.Tensor:
    """The group of each of the ``k`` input channels."""
    if g_idx is not None:
        return g_idx.long()
    return torch.arange(k, device=device) // group_size


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
               group_size: int, g_idx: torch.Tensor | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight [N, K] in ``dtype`` (default: the scales')."""
    dtype = scales.dtype if dtype is None else dtype
    q = unpack(qweight, 1)
    k = q.shape[1]
    if g_idx is None:
        # Contiguous groups: repeat each group's scale and zero over its channels.
        z = qzeros.to(dtype).repeat_interleave(group_size, 1)[:, :k]
        s = scales.to(dtype).repeat_interleave(group_size, 1)[:, :k]
    else:
        groups = g_idx.long()
        z, s = qzeros.to(dtype)[:, groups], scales.to(dtype)[:, groups]
    # (q - z) is an exact small integer in any float dtype: one rounding, in the product.
    return (q.to(dtype) - z) * s


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 qzeros: torch.Tensor, group_size: int, g_idx: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] times the INT4 weight, dequantized to ``x.dtype``, plus ``bias``."""
    w = dequantize(qweight, scales, qzeros, group_size, g_idx, x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def quantize_rtn(w: torch.Tensor, group_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric INT4 of ``w`` [N, K] in tidal's layout: ``(qweight,
    scales float32 [N, G], qzeros uint8 [N, G])`` (random ``--load-format dummy`` weights)."""
    n, k = w.shape
    groups = -(-k // group_size)
    pad = groups * group_size - k
    w32 = F.pad(w.float(), (0, pad)).reshape(n, groups, group_size)
    lo = w32.amin(-1).clamp(max=0.0)
    hi = w32.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    zero = (-lo / scale).round().clamp(0, 15)
    q = (w32 / scale[..., None] + zero[..., None]).round().clamp(0, 15)
    q = q.reshape(n, groups * group_size)[:, :k]
    return pack_rows(q), scale, zero.to(torch.uint8)
