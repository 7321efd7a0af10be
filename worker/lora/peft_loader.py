"""Load a PEFT LoRA adapter into per-module A [r, in] / B [out, r] tensors for this rank.

The files are checked first (``engine_core.lora_adapter.inspect_adapter``: config fields,
tensor names, shapes against the base model, rank limit); the scaling (``lora_alpha / r``, or
``/ sqrt(r)`` with rsLoRA, per module with ``alpha_pattern``) is folded into B in float32, and
each matrix is cut to this tensor-parallel rank's shard the way the base layer is: column-
parallel projections (q/k/v, gate/up) split B's rows, row-parallel ones (o, down) split A's
columns (their partial products are summed by the layer's own all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tidal.engine_core.lora_adapter import LoRAAdapterError, inspect_adapter
from tidal.engine_core.lora_request import LoRARequest
from tidal.engine_core.model_arch import ArchSpec

ROW_PARALLEL = ("o_proj", "down_proj")

# Adapters are keyed by id and path: an id removed and added again for other files is another.
AdapterKey = tuple[int, str]


def adapter_key(lora: LoRARequest) -> AdapterKey:
    return (lora.lora_int_id, lora.lora_path)


@dataclass(slots=True)
class LoadedAdapter:
    key: AdapterKey
    name: str
    # (layer, projection) -> (A [r, in_shard], B [out_shard, r] with the scaling folded in)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ab in self.weights.values() for t in ab)


def _shard_rows(t: torch.Tensor, proj: str, arch: ArchSpec, rank: int, world: int
                ) -> torch.Tensor:
    if world == 1:
        return t
    if proj in ("k_proj", "v_proj"):
        # As QKVParallelLinear: with more ranks than KV heads each head is replicated.
        replicas = max(1, world // arch.num_kv_heads)
        rank, world = rank // replicas, world // replicas
    size = t.shape[0] // world
    return t.narrow(0, rank * size, size)


def _shard_cols(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    if world == 1:
        return t
    size = t.shape[1] // world
    return t.narrow(1, rank * size, size)


def load_adapter(lora: LoRARequest, arch: ArchSpec, max_rank: int, dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1, pin: bool = False) -> LoadedAdapter:
    """Read and shard an adapter (host memory; pinned with ``pin`` for async copies to the
    device). Raises ``LoRAAdapterError`` for an adapter that cannot be served."""
    from safetensors import SafetensorError, safe_open

    spec = inspect_adapter(lora.lora_path, arch, max_rank)
    out = LoadedAdapter(adapter_key(lora), lora.lora_name)
    try:
        with safe_open(spec.weights_file, framework="pt") as f:
            for m in spec.modules:
                a = f.get_tensor(m.a_name)
                # (The scaling folded in float32: B rounded to the dtype once.)
                b = f.get_tensor(m.b_name).to(torch.float32) * m.scaling
                if m.proj in ROW_PARALLEL:
                    a = _shard_cols(a, tp_rank, tp_size)
                else:
                    b = _shard_rows(b, m.proj, arch, tp_rank, tp_size)
                out.weights[(m.layer, m.proj)] = (a.to(dtype).contiguous(),
                                                  b.to(dtype).contiguous())
    except (OSError, SafetensorError) as exc:
        raise LoRAAdapterError(f"cannot read {spec.weights_file}: {exc}") from None
    if pin:
        pack(out, dtype, pin_memory=True)
    return out


# Bytes per pinned host buffer an adapter's matrices are packed into (``pack``). The
# pinned-memory allocator rounds each allocation up to a power of two: one buffer for a whole
# Llama-8B rank-16 adapter (80 MiB) would pin 128 MiB; one per matrix is 448 allocations.
_PIN_BUFFER_BYTES = 16 << 20


def pack(adapter: LoadedAdapter, dtype: torch.dtype, pin_memory: bool,
         buffer_bytes: int = _PIN_BUFFER_BYTES) -> int:
    """Move the adapter's matrices (all of ``dtype``) into a few buffers of about
    ``buffer_bytes`` each, pinned with ``pin_memory`` (page-locked allocations are slow to
    make: one per matrix was about half of a 260 ms hot load on an H100 host); returns how
    many buffers."""
    items = [(key, i, t) for key, ab in adapter.weights.items() for i, t in enumerate(ab)]
    cap = max([buffer_bytes // dtype.itemsize] + [t.numel() for *_, t in items])
    bins: list[list[tuple[tuple[int, str], int, torch.Tensor]]] = [[]]
    used = 0
    for item in items:
        if used + item[2].numel() > cap:
            bins.append([])
            used = 0
        bins[-1].append(item)
        used += item[2].numel()
    moved = {key: list(ab) for key, ab in adapter.weights.items()}
    for group in bins:
        flat = torch.empty(sum(t.numel() for *_, t in group), dtype=dtype,
                           pin_memory=pin_memory)
        at = 0
        for key, i, t in group:
            view = flat[at:at + t.numel()].view(t.shape)
            view.copy_(t)
            moved[key][i] = view
            at += t.numel()
    adapter.weights = {key: (a, b) for key, (a, b) in moved.items()}
    return len(bins)
