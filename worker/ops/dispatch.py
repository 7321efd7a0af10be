"""Which implementation of the fused ops runs: the CUDA extension, Triton, or torch.

The choice is explicit and process-wide (kernels are a per-process resource): ``"auto"`` picks,
for tensors on a GPU, the CUDA extension if it builds, else Triton if it imports, else torch;
``"torch"`` forces the reference path (tests, debugging); ``"triton"``/``"cuda"`` prefer one GPU
path and fall back like auto when it is missing. CPU tensors always take the torch path.

Resolution happens on the first GPU call (that is when the extension is built) and is cached
until the choice changes. Nothing here imports triton or builds anything at import time.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType
from typing import Literal, get_args

import torch

from tidal.worker.ops import torch_ops
from tidal.worker.ops.gpu_info import triton_available

logger = logging.getLogger(__name__)

OpImpl = Literal["auto", "torch", "triton", "cuda"]
_CHOICES: tuple[str, ...] = get_args(OpImpl)


def _resolve(choice: OpImpl) -> ModuleType:
    if choice in ("auto", "cuda"):
        from tidal.worker.ops.cuda_ext import load_extension

        if load_extension() is not None:  # the loader warns once when it can't build
            from tidal.worker.ops import cuda_ops

            return cuda_ops
    if triton_available():
        from tidal.worker.ops import triton_ops

        return triton_ops
    if choice != "auto":
        logger.warning("%s kernels requested but unavailable; using the torch ops", choice)
    return torch_ops


class OpDispatch:
    """Routes each fused op to the implementation module chosen for GPU tensors."""

    def __init__(self, choice: OpImpl = "auto") -> None:
        self._lock = threading.Lock()
        self._choice: OpImpl = "auto"
        self._gpu_impl: ModuleType | None = None
        self.set(choice)

    @property
    def choice(self) -> OpImpl:
        return self._choice

    def set(self, choice: OpImpl) -> None:
        if choice not in _CHOICES:
            raise ValueError(f"op implementation must be one of {_CHOICES}, got {choice!r}")
        with self._lock:
            self._choice = choice
            self._gpu_impl = torch_ops if choice == "torch" else None

    def impl_for(self, x: torch.Tensor) -> ModuleType:
        if not x.is_cuda:
            return torch_ops
        impl = self._gpu_impl
        if impl is None:
            with self._lock:
                if self._gpu_impl is None:
                    self._gpu_impl = _resolve(self._choice)
                impl = self._gpu_impl
        return impl

    def active_name(self, device: torch.device) -> str:
        """'cuda', 'triton' or 'torch': what ops on ``device`` run on (resolving if needed)."""
        probe = torch.empty(0, device=device)
        impl = self.impl_for(probe)
        return {"tidal.worker.ops.cuda_ops": "cuda", "tidal.worker.ops.triton_ops": "triton"}.get(
            impl.__name__, "torch"
        )
