"""``--cpu-offload-gb``: whole decoder layers' weights kept in (pinned) host memory and copied to
the GPU just before each layer runs, so a model larger than the GPU still runs.

Which layers: this stage's last ones, backwards, while their bytes stay within the budget. The
choice is made as the model is built (``layer_built``, called by the decoder for each layer):
an offloaded layer's parameters move to host memory right after it is built, so the device
never holds the whole model, and the checkpoint then loads straight into host memory.

How they run: the offloaded layers share two reusable device *staging* buffers (one for a
single layer): layer ``k``'s parameters are views into slot ``k % 2``. A forward pre-hook on
every layer of the stage waits for its own copy and starts the next offloaded layer's copy on a
side stream, so the host-to-device copy of layer ``k + 1`` overlaps layer ``k``'s compute. A copy
into a slot is ordered (``wait_stream``) after everything already launched on the compute
stream, which includes the last layer that read the slot. The staging buffers never move and
the copies read fixed pinned addresses, so a CUDA graph captures the copies with the layers
(the side stream forks from and joins the capturing stream through events): graphs stay on.

Without CUDA (``stream`` None) the copies are plain synchronous copies: the machinery runs on
a CPU with a "host" and a "device" that are both the CPU, which is how it is unit-tested.

Before loading, the runner checks the weights fit with the same choice made over a ``meta``
model (``plan_only``: nothing moves): the device holds the layers not offloaded plus the two
staging buffers (``device_weight_bytes``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Byte alignment of each parameter inside a layer's host and staging buffers.
_ALIGN = 256

_BUILDING: contextvars.ContextVar[LayerOffloader | None] = contextvars.ContextVar(
    "tidal_cpu_offload", default=None)


def layer_built(index: int, layer: nn.Module) -> nn.Module:
    """Called by the decoder for each layer it builds, in execution order; returns ``layer``.
    Inside ``offloading(offloader)`` the offloader sees it (and may move its weights to host
    memory); elsewhere it does nothing."""
    offloader = _BUILDING.get()
    if offloader is not None:
        offloader.add_layer(index, layer)
    return layer


@contextlib.contextmanager
def offloading(offloader: LayerOffloader | None) -> Iterator[None]:
    """Build (and load) a model with ``offloader`` choosing its layers; None: no offload."""
    token = _BUILDING.set(offloader)
    try:
        yield
    finally:
        _BUILDING.reset(token)


@dataclass(slots=True, eq=False)
class _Offloaded:
    """One offloaded layer: its parameters, their byte offsets in the layer's host buffer."""

    params: list[nn.Parameter]
    offsets: list[int]
    host: torch.Tensor  # uint8, pinned on a GPU host
    nbytes: int
    ready: Any = None  # torch.cuda.Event: the layer's copy has landed


def _layout(params: list[nn.Parameter]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for p in params:
        offsets.append(end)
        end += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    return offsets, end


def _view(buf: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
    """``p``'s shape and dtype over ``buf``'s bytes from ``offset``."""
    n = p.numel() * p.element_size()
    return buf[offset:offset + n].view(p.dtype).view(p.shape)


@dataclass(slots=True, eq=False)
class LayerOffloader:
    """Keeps up to ``budget`` bytes of a stage's decoder layers in host memory and streams them
    to ``device`` layer by layer. ``layer_ids``: the stage's layers, in execution order."""

    budget: int
    device: torch.device
    layer_ids: tuple[int, ...]
    pin: bool = True  # page-locked host memory (False: plain memory, for CPU tests)
    # Choose the layers only (a ``meta`` model sized before loading): nothing moves.
    plan_only: bool = False
    _order: list[nn.Module] = field(default_factory=list)  # every layer seen, in order
    _offloaded: dict[int, _Offloaded] = field(default_factory=dict)  # position -> layer
    _used: int = 0
    _moved: set[int] = field(default_factory=set)  # ids of the parameters moved to the host
    _tail: int | None = None  # how many of the last layers to offload (from the first's size)
    staging: list[torch.Tensor] = field(default_factory=list)
    stream: Any = None  # the side stream of the copies (CUDA only)
    _slot_of: dict[int, int] = field(default_factory=dict)  # position -> staging slot
    _hooks: list[Any] = field(default_factory=list)

    # --- choosing and moving (model build) --------------------------------------------------

    def add_layer(self, index: int, layer: nn.Module) -> None:
        position = len(self._order)
        self._order.append(layer)
        # (Unique, in order; a parameter shared with an earlier layer stays where it is.)
        params = [p for p in dict.fromkeys(layer.parameters()) if id(p) not in self._moved]
        nbytes = _layout(params)[1]
        if self._tail is None:
            # The stage's layers are alike (one decoder layer class): the budget covers this
            # many of them, counted from the last.
            self._tail = min(len(self.layer_ids), self.budget // max(1, nbytes))
        first = len(self.layer_ids) - self._tail
        if not params or index not in self.layer_ids[first:] or \
                self._used + nbytes > self.budget:
            return
        self._used += nbytes
        self._moved.update(id(p) for p in params)
        self._offloaded[position] = (
            _Offloaded(params, _layout(params)[0], torch.empty(0, dtype=torch.uint8), nbytes)
            if self.plan_only else self._to_host(params))

    @torch.no_grad()
    def _to_host(self, params: list[nn.Parameter]) -> _Offloaded:
        offsets, nbytes = _layout(params)
        # (device named: the model is built under ``torch.device(cuda)``)
        host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
        for p, off in zip(params, offsets):
            view = _view(host, off, p)
            view.copy_(p.data)  # (values set at build, e.g. norm weights, survive)
            p.data = view  # the device copy is freed; the checkpoint loads into host memory
        return _Offloaded(params, offsets, host, nbytes)

    @property
    def offloaded_bytes(self) -> int:
        return self._used

    @property
    def num_offloaded(self) -> int:
        return len(self._offloaded)

    def offloaded_positions(self) -> list[int]:
        return sorted(self._offloaded)

    def is_offloaded(self, param: torch.Tensor) -> bool:
        return id(param) in self._moved

    @property
    def staging_bytes(self) -> int:
        """Device bytes of the staging buffers ``finalize`` allocates: two (one for a single
        layer) of the largest offloaded layer's size."""
        if not self._offloaded:
            return 0
        return min(2, len(self._offloaded)) * max(o.nbytes for o in self._offloaded.values())

    # --- running (after the weights loaded) -------------------------------------------------

    def finalize(self) -> None:
        """Point the offloaded parameters at the staging buffers and hook every layer."""
        if not self._order:
            raise RuntimeError("--cpu-offload-gb is not yet supported for this model family "
                               "(its layers are not built through the decoder)")
        if not self._offloaded:
            logger.warning("--cpu-offload-gb: the budget of %.2f GiB holds no whole decoder "
                           "layer; nothing is offloaded", self.budget / 2**30)
            return
        if self.plan_only:
            raise RuntimeError("a plan-only offloader sizes a model; it does not run one")
        layers = [self._offloaded[p] for p in sorted(self._offloaded)]
        size = max(layer.nbytes for layer in layers)
        slots = min(2, len(layers))
        self.staging = [torch.empty(size, dtype=torch.uint8, device=self.device)
                        for _ in range(slots)]
        for k, layer in enumerate(layers):
            buf = self.staging[k % slots]
            for p, off in zip(layer.params, layer.offsets):
                p.data = _view(buf, off, p)
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            for layer in layers:
                layer.ready = torch.cuda.Event()
        self._slot_of = {p: k % slots for k, p in enumerate(sorted(self._offloaded))}
        for position, module in enumerate(self._order):
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook(position)))
        logger.info("CPU offload: %d of %d decoder layers (%.2f GiB) stream from %s host "
                    "memory through %d staging buffer(s) of %.1f MiB", len(layers),
                    len(self._order), self._used / 2**30, "pinned" if self.pin else "pageable",
                    slots, size / 2**20)

    def _pre_hook(self, position: int):
        offloaded = self._offloaded
        mine = offloaded.get(position)
        nxt = position + 1 if position + 1 in offloaded else None
        first = position == 0 and mine is not None  # nobody before it starts its copy

        def hook(module: nn.Module, args: Any) -> None:
            if first:
                self._copy(position)
            if mine is not None and mine.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(mine.ready)
            if nxt is not None:
                self._copy(nxt)

        return hook

    def _copy(self, position: int) -> None:
        """Copy the layer at ``position`` into its staging slot, after everything launched so
        far (the last reader of that slot among it) and, on CUDA, on the side stream."""
        layer = self._offloaded[position]
        dst = self.staging[self._slot_of[position]][:layer.nbytes]
        if self.stream is None:
            dst.copy_(layer.host)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(layer.host, non_blocking=True)
            layer.ready.record(self.stream)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.staging = []
        self._offloaded.clear()


def device_weight_bytes(model: nn.Module, offloader: LayerOffloader | None) -> int:
    """Bytes of ``model``'s parameters (each counted once) the device holds once loaded with
    ``offloader`` choosing its layers (None: every parameter): those not offloaded, plus the
    staging buffers the offloaded layers stream through."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen or (offloader is not None and offloader.is_offloaded(p)):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total + (offloader.staging_bytes if offloader is not None else 0)
