"""LoRA on the base model's linears, by composition: a ``LoRALayer`` hangs on a linear
(``LinearBase.lora``) and adds its product inside ``LinearBase.matmul``, after the base GEMM
and before a row-parallel layer's all-reduce (each rank adds its partial product; the reduce
sums them with the base's). One row on the GPU (batch-1 decode, one rank) takes ``gemv``
instead: a shrink that also applies the norm before the linear, then the GEMV that adds the
expand to its rows before its epilogue; two kernels where ``add`` after a fused norm + GEMV
runs up to six. Linears of an engine without ``--enable-lora`` carry None and run exactly as
before.

Each layer owns its slot buffers, allocated once at start-up: ``a`` [max_loras, S*R, in] and
``b`` [max_loras, out, R] (S output slices: q/k/v, gate/up, or one), zero-padded to the
largest rank R. A slot is filled by copying (``load_slot``), never by allocating.
"""

from __future__ import annotations

from dataclasses import dataclass

import importlib

import torch

from tidal.worker.ops.kernels import Kernels

# The ``tidal::lora_*`` ops a compiled model's trace holds (``compilation/custom_ops``).
importlib.import_module("tidal.worker.compilation.custom_ops")


@dataclass(slots=True)
class LoRASegments:
    """The runs of consecutive tokens sharing one adapter in an eager step (device tensors,
    int32), for the segmented kernels; base-model tokens are in no run."""

    start: torch.Tensor
    length: torch.Tensor
    slot: torch.Tensor
    num: int
    max_len: int
    # Rows of the runs through this permutation of the tokens (sorted by adapter), or None:
    # the runs are of consecutive tokens.
    perm: torch.Tensor | None = None


class LoRAContext:
    """Per-step metadata every LoRA layer reads: each token's slot (-1: the base model) in a
    persistent device buffer (CUDA graphs capture its address, and replay what the step wrote
    into it), and, in eager steps, the runs for the segmented kernels.

    The shrink kernels of small batches sum slices of their inputs atomically into a zeroed
    float32 output; a forward pass of up to ``scratch_rows`` tokens takes those outputs from
    one scratch buffer (every layer's [T, S*R] block side by side), zeroed once by its first
    user, instead of one zeroing kernel per LoRA'd linear (128 in a Llama-8B step)."""

    __slots__ = ("token_slots", "segments", "perm", "tiles", "scratch", "scratch_rows",
                 "scratch_width", "_forward", "_rows")

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.segments: LoRASegments | None = None
        # Grouped decode (lora/grouping.py): the tokens sorted by adapter and the tile table
        # (starts, lengths, slots) [3, tiles]; None unless the manager groups.
        self.perm: torch.Tensor | None = None
        self.tiles: torch.Tensor | None = None
        self.scratch: torch.Tensor | None = None  # float32 [scratch_rows * scratch_width]
        self.scratch_rows = 0
        self.scratch_width = 0  # S*R summed over the layers
        self._forward = 0  # forward passes begun (``begin_forward``)
        # The tokens this pass zeroed the scratch for (0: not yet; -1: no pass open, the model's
        # forward hooks bracket each: a block is only ever handed out inside one).
        self._rows = -1

    def use_scratch(self, layers: list[LoRALayer], max_rows: int, max_bytes: int) -> None:
        """Give the shrinks of ``layers`` (in model order) blocks of one scratch buffer for
        passes of up to ``max_rows`` tokens, in at most ``max_bytes`` (fewer rows if need
        be; none fit: no scratch)."""
        width = 0
        for layer in layers:
            layer.scratch_at = width
            # (Each block 16-byte aligned whatever the row count: vector loads and stores.)
            width += -(-layer.a.shape[1] // 4) * 4
        rows = min(max_rows, max_bytes // (torch.float32.itemsize * max(width, 1)))
        self.scratch_rows, self.scratch_width = rows, width
        self.scratch = (torch.empty(rows * width, dtype=torch.float32,
                                    device=self.token_slots.device) if rows > 0 else None)

    def begin_forward(self) -> None:
        """A forward pass starts (the model's pre-hook): its first shrink zeroes the scratch."""
        self._forward += 1
        self._rows = 0

    def end_forward(self) -> None:
        """The pass is over (the model's forward hook): no blocks until the next begins."""
        self._rows = -1

    def zeroed(self, layer: LoRALayer, rows: int) -> torch.Tensor | None:
        """``layer``'s zeroed float32 [rows, S*R] block of the scratch for this pass, or None:
        no scratch or no pass open, too many rows, or not the pass's row count or the layer's
        first use in it (a block is written once per zeroing); the shrink then zeroes an
        output of its own."""
        if self.scratch is None or self._rows < 0 or not 0 < rows <= self.scratch_rows or \
                layer.scratch_pass == self._forward or torch.compiler.is_compiling():
            return None
        if not self._rows:
            # (Inside a CUDA graph capture this zeroing is captured too: each replay zeroes.)
            self.scratch[:rows * self.scratch_width].zero_()
            self._rows = rows
        elif rows != self._rows:
            return None
        layer.scratch_pass = self._forward
        width = layer.a.shape[1]
        start = rows * layer.scratch_at
        return self.scratch[start:start + rows * width].view(rows, width)


class LoRALayer:
    __slots__ = ("a", "b", "offsets", "sizes", "projs", "rank", "ctx", "kernels",
                 "scratch_at", "scratch_pass")

    def __init__(self, projs: tuple[str, ...], sizes: tuple[int, ...], in_features: int,
                 num_slots: int, rank: int, dtype: torch.dtype, device: torch.device,
                 ctx: LoRAContext, kernels: Kernels) -> None:
        self.projs, self.sizes, self.rank = projs, sizes, rank
        offsets, at = [], 0
        for n in sizes:
            offsets.append(at)
            at += n
        self.offsets = tuple(offsets)
        self.a = torch.zeros(num_slots, len(projs) * rank, in_features, dtype=dtype,
                             device=device)
        self.b = torch.zeros(num_slots, at, rank, dtype=dtype, device=device)
        self.ctx, self.kernels = ctx, kernels
        # Its block of ``ctx.scratch``: this many S*R columns of the layers before it, per row.
        self.scratch_at = 0
        self.scratch_pass = 0  # the forward pass that last took its block

    @property
    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def load_slot(self, slot: int, proj: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Copy one projection's A [r, in] / B [out, r] into ``slot`` (ranks below the
        maximum stay zero-padded: clear the slot first)."""
        s = self.projs.index(proj)
        r = a.shape[0]
        start, size = self.offsets[s], self.sizes[s]
        if a.shape[1] != self.a.shape[2] or b.shape[0] != size or r > self.rank:
            raise ValueError(f"LoRA {proj}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                             f"[<= {self.rank}, {self.a.shape[2]}] / [{size}, <= {self.rank}]")
        self.a[slot, s * self.rank:s * self.rank + r].copy_(a, non_blocking=True)
        self.b[slot, start:start + size, :r].copy_(b, non_blocking=True)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus every token's adapter product (in place when shapes allow)."""
        ctx = self.ctx
        if not y.is_contiguous():
            y = y.contiguous()
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.reshape(-1, y.shape[-1])
        slots = ctx.token_slots[:x2.shape[0]]
        # (A compiled graph takes no per-step host metadata: per-token kernels there.)
        segments = None if torch.compiler.is_compiling() else ctx.segments
        xa = self.kernels.lora_shrink(x2, self.a, slots, segments,
                                      out=ctx.zeroed(self, x2.shape[0]))
        self.kernels.lora_expand(y2, xa, self.b, slots, self.offsets, self.rank, segments)
        return y

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
             norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None,
             eps: float = 0.0, act: str | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One row through the linear of ``weight`` with this layer's adapters, norm before
        and gated activation after it included (``Kernels.lora_gemv``, where
        ``LinearBase.lora_gemv_applies``): two kernels, the token's slot read on the device."""
        return self.kernels.lora_gemv(x, weight, bias, self.a, self.b, self.ctx.token_slots[:1],
                                      self.offsets, self.rank, norm_weight=norm_weight,
                                      residual=residual, eps=eps, act=act)
