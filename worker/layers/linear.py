"""Linear layers that know how to shard themselves and load their checkpoint tensors.

Column-parallel layers split the output features across tensor-parallel ranks; row-parallel
layers split the input features and all-reduce the result. Fused layers (q/k/v, gate/up) stack
several checkpoint tensors; each parameter's ``weight_loader`` puts a tensor (or one shard of a
fused tensor) in its place and checks the shape, naming what did not fit.

The loaded tensor may be a lazy checkpoint tensor (``loader.safetensors_weights.LazyTensor``:
``shape``, ``narrow``, ``materialize``): loaders only ever ``narrow`` it to their shard or
``as_tensor`` it whole, so a tensor-parallel rank reads just its own slice from the file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tidal.worker.distributed.parallel_state import ParallelGroup, single_group
from tidal.worker.distributed.pending_sum import PendingSum
from tidal.worker.kernel_policy import current_kernels
from tidal.worker.layers import fp8, fp8_block, int4
from tidal.worker.ops.fp8_torch import FP8_DTYPE


class WeightShapeError(ValueError):
    pass


def set_weight_loader(param: nn.Parameter, loader: Callable[..., None]) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def as_tensor(t: Any) -> torch.Tensor:
    """A real tensor from a loaded one (reads a lazy checkpoint tensor whole)."""
    return t if isinstance(t, torch.Tensor) else t.materialize()


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise WeightShapeError(
            f"shape mismatch: the model expects {tuple(param.shape)}, the checkpoint has "
            f"{tuple(loaded.shape)}"
        )
    param.data.copy_(as_tensor(loaded))


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise WeightShapeError(
            f"shape mismatch for {what}: the model expects {tuple(dst.shape)}, the checkpoint "
            f"gives {tuple(src.shape)}"
        )
    dst.copy_(as_tensor(src))


def _shard(t: torch.Tensor, dim: int, index: int, count: int, what: str) -> torch.Tensor:
    if t.shape[dim] % count:
        raise WeightShapeError(
            f"{what}: dimension {dim} of size {t.shape[dim]} does not split into {count} shards"
        )
    size = t.shape[dim] // count
    return t.narrow(dim, index * size, size)


class LinearBase(nn.Module):
    # Row-parallel layers shard the input features; every rank holds every output row.
    input_sharded = False
    # LoRA adapters' slot buffers (worker/lora/layers.py), hung here by the model runner with
    # --enable-lora; None: the plain linear.
    lora: Any = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        tp: ParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp or single_group()
        self.kernels = current_kernels()
        self.in_features = in_features
        self.out_features = out_features
        # Built under ``fp8.quantizing``: FP8 weights with per-row scales (layers/fp8.py).
        quant = fp8.current_quant()
        # AWQ / GPTQ: no 16-bit ``weight``, packed INT4 tensors instead (layers/int4.py).
        self.w4a16: int4.Int4Layout | None = None
        # Block-wise FP8 checkpoints: e4m3 ``weight``, ``weight_scale_inv`` per block
        # (layers/fp8_block.py); ``weight_scale`` None, so no per-row FP8 path takes them.
        self.fp8_block: fp8_block.Fp8BlockLayout | None = None
        if quant is not None and quant.int4:
            for name in ("weight", "weight_scale", "input_scale"):
                self.register_parameter(name, None)
            self.w4a16 = int4.attach(self, quant, dtype)
        else:
            self.weight = nn.Parameter(
                torch.empty(out_features, in_features,
                            dtype=dtype if quant is None else FP8_DTYPE), requires_grad=False)
            set_weight_loader(self.weight, self.weight_loader)
        if quant is None:
            self.register_parameter("weight_scale", None)
            self.register_parameter("input_scale", None)
        elif quant.weight_block is not None:
            self.fp8_block = fp8_block.attach(self, quant)
        elif not quant.int4:
            fp8.attach(self, quant)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)

    def checkpoint_rows(self, shard_id: object = None) -> int:
        """Rows of the checkpoint tensor that fills part ``shard_id`` (all ranks together)."""
        return self.out_features

    @staticmethod
    def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
        _copy_checked(dst, src, what)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``base_matmul``, plus the LoRA adapters' products where ``--enable-lora`` hung a
        ``worker.lora.layers.LoRALayer`` here (a row-parallel layer adds its partial product
        before the all-reduce, which sums it with the base's). One row on the GPU: the GEMV
        adds them itself (``lora_gemv_applies``)."""
        if self.lora is not None:
            if self.lora_gemv_applies(x, bias):
                return self.lora.gemv(x, self.weight, bias)[0]
            return self.lora.add(x, self.base_matmul(x, bias))
        return self.base_matmul(x, bias)

    def lora_gemv_applies(self, x: Any, bias: torch.Tensor | None = None,
                          norm_weight: torch.Tensor | None = None,
                          residual: torch.Tensor | None = None, act: str | None = None) -> bool:
        """Whether this layer's adapters fold into its one-row GEMV (``LoRALayer.gemv``) for
        ``x``, with this norm before and gated activation after: a LoRA'd plain 16/32-bit
        weight (FP8 and INT4 ones keep their own kernels), one rank (the GEMVs that fuse the
        tensor-parallel all-reduce add no adapter term), and where
        ``Kernels.lora_gemv_applies``."""
        lora = self.lora
        return (lora is not None and self.tp.world_size == 1 and self.plain_weight
                and isinstance(x, torch.Tensor)
                and lora.kernels.lora_gemv_applies(x, self.weight, bias, norm_weight,
                                                   residual, act))

    @property
    def plain_weight(self) -> bool:
        """Whether ``weight`` is a plain 16/32-bit one (no FP8, block-wise FP8 or INT4): what
        the fused 16-bit kernels (GEMVs with LoRA, the push all-reduce) may read."""
        return self.w4a16 is None and self.fp8_block is None and self.weight_scale is None

    def base_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` times this rank's weight (plus ``bias``), FP8, INT4 or not."""
        if self.w4a16 is not None:
            return int4.matmul(self, x, bias)
        if self.fp8_block is not None:
            return fp8_block.matmul(self, x, bias)
        if self.weight_scale is not None:
            return self.kernels.fp8_linear(x, self.weight, self.weight_scale, bias,
                                           self.input_scale)
        return self.kernels.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.linear, except a single row on the GPU (batch-1 decode), which takes the GEMV
        # kernel where the policy has it: cuBLAS runs such shapes on too few CTAs.
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank's output is its slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 tp: ParallelGroup | None = None) -> None:
        tp = tp or single_group()
        if out_features % tp.world_size:
            raise ValueError(f"{out_features} output features do not split over {tp.world_size}")
        super().__init__(in_features, out_features // tp.world_size, bias, dtype, tp)

    def checkpoint_rows(self, shard_id: object = None) -> int:
        return self.out_features * self.tp.world_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        part = _shard(loaded, 0, self.tp.rank, self.tp.world_size, "column-parallel weight")
        _copy_checked(param.data, part, "column-parallel weight")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stacked on the output dim (e.g. gate and up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 dtype: torch.dtype, tp: ParallelGroup | None = None) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, dtype, tp)

    def checkpoint_rows(self, shard_id: object = None) -> int:
        return self.output_sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            raise WeightShapeError("a fused gate/up tensor needs a shard id")
        world, rank = self.tp.world_size, self.tp.rank
        offset = sum(self.output_sizes[:shard_id]) // world
        size = self.output_sizes[shard_id] // world
        part = _shard(loaded, 0, rank, world, f"shard {shard_id}")
        _copy_checked(param.data.narrow(0, offset, size), part, f"shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused; heads split across ranks. When there are more ranks than
    KV heads, each KV head is replicated on ``world_size // num_kv_heads`` ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, dtype: torch.dtype, tp: ParallelGroup | None = None) -> None:
        tp = tp or single_group()
        world = tp.world_size
        self.head_dim = head_dim
        self.num_heads = num_heads // world
        self.num_kv_heads = max(1, num_kv_heads // world)
        self.total_num_kv_heads = num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * world
        super().__init__(hidden_size, out, bias, dtype, tp)

    def checkpoint_rows(self, shard_id: object = None) -> int:
        if shard_id == "q":
            return self.num_heads * self.tp.world_size * self.head_dim
        return self.total_num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        d = self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        world, rank = self.tp.world_size, self.tp.rank
        if shard_id == "q":
            offset, size, part = 0, q, _shard(loaded, 0, rank, world, "q")
        elif shard_id in ("k", "v"):
            offset = q if shard_id == "k" else q + kv
            size = kv
            replicas = max(1, world // self.total_num_kv_heads)
            part = _shard(loaded, 0, rank // replicas, world // replicas, shard_id)
        else:
            raise WeightShapeError(f"unknown q/k/v shard id {shard_id!r}")
        _copy_checked(param.data.narrow(0, offset, size), part, f"{shard_id} projection")


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial results are summed with one all-reduce."""

    input_sharded = True

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 tp: ParallelGroup | None = None, reduce_results: bool = True) -> None:
        tp = tp or single_group()
        if in_features % tp.world_size:
            raise ValueError(f"{in_features} input features do not split over {tp.world_size}")
        super().__init__(in_features // tp.world_size, out_features, bias, dtype, tp)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: whole on every rank, added once after the reduce
            _copy_checked(param.data, loaded, "row-parallel bias")
            return
        part = _shard(loaded, 1, self.tp.rank, self.tp.world_size, "row-parallel weight")
        _copy_checked(param.data, part, "row-parallel weight")

    def forward(self, x: torch.Tensor, defer_reduce: bool = False) -> torch.Tensor | PendingSum:
        """``defer_reduce``: the caller takes a ``PendingSum`` (a batch-1 decode step feeding
        ``Kernels.rms_norm_linear``), letting the all-reduce fuse with the norm where it can."""
        if defer_reduce and self.reduce_results and self.bias is None:
            push = self.tp.push_all_reduce
            if push is not None and self.w4a16 is None and self.fp8_block is None \
                    and self.lora is None and push.applies(x, self.weight):
                return push.gemv(x, self.weight, self.weight_scale)
            return self.tp.defer_all_reduce(self.matmul(x, None))
        y = self.matmul(x, None)
        if self.reduce_results:
            y = self.tp.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
