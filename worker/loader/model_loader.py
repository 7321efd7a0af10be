"""Build a model on the target device and fill its weights from a checkpoint or at random."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch
from torch import nn

from tidal.engine_core.config import ModelConfig
from tidal.worker.attention.backend import AttentionImpl
from tidal.worker.distributed.parallel_state import ParallelGroup
from tidal.worker.layers import fp8, fp8_block, int4
from tidal.worker.models.decoder import AuxHiddenSpec
from tidal.worker.models.registry import build_model
from tidal.worker.ops.kernels import Kernels

logger = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    pass


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16,
            "bfloat16": torch.bfloat16}[name]


def load_model(config: ModelConfig, device: torch.device, impl: AttentionImpl,
               tp: ParallelGroup | None = None, pp: ParallelGroup | None = None,
               kernels: Kernels | None = None,
               aux_hidden: AuxHiddenSpec | None = None) -> nn.Module:
    """``aux_hidden``: the model also records the hidden states entering those layers (the
    target of an EAGLE-3 draft head; ``models.decoder.AuxHiddenSpec``)."""
    start = time.perf_counter()
    dtype = torch_dtype(config.dtype)
    # Parameters are created directly where they will live: no CPU copy of the whole model.
    with torch.device(device), fp8.quantizing(config.quantization):
        model = build_model(config.arch, dtype, impl, tp, pp, kernels, aux_hidden)
    model.eval()
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed, draw_device=device)
    else:
        _load_checkpoint(model, config)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("loaded %s (%s, %.1fM parameters, %s) on %s in %.2f s", config.served_model_name,
                config.load_format, n_params / 1e6, config.dtype, device,
                time.perf_counter() - start)
    return model


def _load_checkpoint(model: nn.Module, config: ModelConfig) -> None:
    current = {"file": config.path}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        if config.load_format == "gguf":
            from tidal.worker.loader.gguf_weights import iter_gguf_weights

            for name, tensor in iter_gguf_weights(config.path):
                yield name, tensor
        else:
            from tidal.worker.loader.safetensors_weights import iter_safetensors

            # Models whose weight loaders take lazy tensors read only their own shards.
            lazy = bool(getattr(model, "supports_lazy_weights", False))
            quant = config.quantization
            # A compressed-tensors block scale fills the block layers' ``weight_scale_inv``.
            rename = (quant is not None and quant.weight_block is not None
                      and quant.block_scale_name == "weight_scale")
            for name, tensor, path in iter_safetensors(config.path, lazy=lazy):
                current["file"] = path
                if rename and name.endswith(".weight_scale"):
                    name += "_inv"
                yield name, tensor

    try:
        model.load_weights(tensors())
    except (ValueError, FileNotFoundError) as exc:
        message = str(exc)
        if current["file"] not in message:
            message = f"{current['file']}: {message}"
        raise ModelLoadError(message) from exc


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, low: float = -1e-3,
                       high: float = 1e-3, draw_device: torch.device | None = None) -> None:
    """Small uniform random weights (norm weights stay 1), reproducible from ``seed``.

    Drawn on the parameter's own device: an 8B model initialises in seconds on a GPU. A
    parameter kept elsewhere (host memory: --cpu-offload-gb) is drawn on ``draw_device`` and
    copied over, so it gets the values it would have had there."""
    gens: dict[torch.device, torch.Generator] = {}

    def gen_for(device: torch.device) -> torch.Generator:
        gen = gens.get(device)
        if gen is None:
            gen = gens[device] = torch.Generator(device=device).manual_seed(seed)
        return gen

    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        if param.dtype == torch.float8_e4m3fn or name.endswith(
                ("weight_scale", "input_scale", "weight_scale_inv")):
            continue  # FP8 layers: drawn in float32 and quantized below
        if not param.is_floating_point() or name.endswith(".scales"):
            continue  # INT4 layers: likewise
        if "norm" in name:
            param.fill_(1.0)
            continue
        if draw_device is not None and param.device != draw_device:
            drawn = torch.empty(param.shape, dtype=param.dtype, device=draw_device)
            param.copy_(drawn.uniform_(low, high, generator=gen_for(draw_device)))
            continue
        param.uniform_(low, high, generator=gen_for(param.device))
    for module in model.modules():
        if getattr(module, "weight_scale", None) is not None:
            fp8.dummy_fill(module, low, high, gen_for(module.weight.device))
        elif getattr(module, "fp8_block", None) is not None:
            fp8_block.dummy_fill(module, low, high, gen_for(module.weight.device))
        elif getattr(module, "w4a16", None) is not None:
            int4.dummy_fill(module, low, high, gen_for(module.qweight.device))
        elif getattr(module, "w13_weight_scale", None) is not None:  # FP8 MoE experts
            module.dummy_fill(low, high, gen_for(module.w13.device))
