"""How the layers share the KV cache: groups of layers by attention type over one block pool.

Layers are sorted by attention type (full attention; one sliding-window type per distinct window
W). Every type is cut into groups of ``g`` layers (the last group of a type padded with unused
slots), and the cache is laid out *by slot*: ``g`` tensors of ``[2, num_blocks, ...]``, the j-th
shared by the j-th layer of every group. A pool block id is owned by one group at a time and
addresses that group's ``g`` layers at once, so all groups allocate from one pool with one page
size, and a sliding-window group that holds only its window's blocks leaves the rest of the
pool to the others.

``g`` keeps the padding (unused slots / all slots) within ``MAX_PADDING_WASTE``; among those
sizes it pads full-attention groups as little as possible (a padded full-attention slot holds a
whole context's worth of blocks, a padded sliding slot only a window's: at long contexts the
former is what counts), then makes the fewest groups (every group keeps its own block table per
request). A model whose layers are all full attention has one group of all its layers: the
layout is exactly one tensor per layer.

Both sides compute the layout from the config: the scheduler for the block accounting, each
worker for its tensors and block tables.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tidal.engine_core.model_arch import ArchSpec

logger = logging.getLogger(__name__)

MAX_PADDING_WASTE = 0.05


@dataclass(slots=True, frozen=True)
class KVGroup:
    window: int | None  # None: full attention
    layers: tuple[int, ...]  # global layer indices, slot j holds layers[j] (fewer than g: padded)

    @property
    def kind(self) -> str:
        return "full" if self.window is None else f"sliding({self.window})"


@dataclass(slots=True, frozen=True)
class KVLayout:
    group_size: int  # g: layers (tensor slots) per group
    groups: tuple[KVGroup, ...]
    layer_group: tuple[int, ...]  # global layer -> its group
    layer_slot: tuple[int, ...]  # global layer -> its slot (tensor) in 0..g-1

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def hybrid(self) -> bool:
        """True unless the layout is today's: one group of full-attention layers."""
        return len(self.groups) > 1 or self.groups[0].window is not None

    @property
    def has_sliding(self) -> bool:
        return any(g.window is not None for g in self.groups)

    @property
    def padding_waste(self) -> float:
        slots = self.group_size * len(self.groups)
        return (slots - len(self.layer_group)) / slots if slots else 0.0

    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    def blocks_per_seq(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Pool blocks one sequence of ``num_tokens`` holds at most while it computes ``chunk``
        tokens per step (each group's own, plus the null block that sliding groups put in place
        of the blocks they dropped)."""
        n = 0
        full = -(-num_tokens // block_size)
        for g in self.groups:
            n += full if g.window is None else min(
                full, window_blocks(g.window, block_size, min(chunk, num_tokens)))
        return n + (1 if self.has_sliding else 0)

    def describe(self) -> str:
        parts = []
        by_kind: dict[str, list[KVGroup]] = {}
        for g in self.groups:
            by_kind.setdefault(g.kind, []).append(g)
        for kind, groups in by_kind.items():
            n = sum(len(g.layers) for g in groups)
            parts.append(f"{kind}: {n} layers in {len(groups)} group(s)")
        return (f"{len(self.groups)} KV group(s) of g={self.group_size} layers "
                f"({'; '.join(parts)}), padding waste {100 * self.padding_waste:.1f}%")


def window_blocks(window: int, block_size: int, new_tokens: int = 1) -> int:
    """The most blocks a sliding group needs to compute ``new_tokens`` tokens: the first one's
    W - 1 earlier positions and the new tokens may straddle one block more than they fill."""
    return -(-(window + new_tokens - 2) // block_size) + 1


def choose_group_size(type_sizes: list[int], full: list[bool] | None = None,
                      max_waste: float = MAX_PADDING_WASTE) -> int:
    """The group size for types of ``type_sizes`` layers (``full[i]``: type i is full
    attention): padding waste within ``max_waste`` (g = 1 never wastes anything), then the
    fewest padded full-attention slots, then the fewest groups, then the least waste."""
    total = sum(type_sizes)
    if total == 0:
        return 1
    full = full or [False] * len(type_sizes)
    best: tuple[int, int, float] | None = None
    best_g = 1
    for g in range(1, max(type_sizes) + 1):
        groups = sum(-(-n // g) for n in type_sizes)
        waste = (groups * g - total) / (groups * g)
        if waste > max_waste + 1e-12:
            continue
        full_pad = sum(-(-n // g) * g - n for n, f in zip(type_sizes, full) if f)
        key = (full_pad, groups, waste)
        if best is None or key < best:
            best, best_g = key, g
    return best_g


def layer_windows(arch: ArchSpec) -> list[int | None]:
    return [arch.layer_sliding_window(i) for i in range(arch.num_layers)]


def build_layout(windows: list[int | None], hybrid: bool = True,
                 max_waste: float = MAX_PADDING_WASTE) -> KVLayout:
    """Group layers (``windows[i]``: layer i's sliding window, None for full attention).
    ``hybrid`` False: every layer is treated as full attention (one group; the windows still
    mask the scores, but no block is ever dropped)."""
    n_layers = len(windows)
    if not hybrid or n_layers == 0:
        windows = [None] * n_layers
    by_type: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        by_type.setdefault(w, []).append(i)
    # Full attention first, then windows from the smallest: a stable, readable order.
    kinds = sorted(by_type, key=lambda w: (w is not None, w or 0))
    if not kinds:
        return KVLayout(1, (KVGroup(None, ()),), (), ())
    g = choose_group_size([len(by_type[k]) for k in kinds], [k is None for k in kinds],
                          max_waste)
    groups: list[KVGroup] = []
    layer_group = [0] * n_layers
    layer_slot = [0] * n_layers
    for kind in kinds:
        layers = by_type[kind]
        for start in range(0, len(layers), g):
            members = tuple(layers[start:start + g])
            for slot, layer in enumerate(members):
                layer_group[layer] = len(groups)
                layer_slot[layer] = slot
            groups.append(KVGroup(kind, members))
    return KVLayout(g, tuple(groups), tuple(layer_group), tuple(layer_slot))


def layout_for(arch: ArchSpec, hybrid: bool = True, max_model_len: int | None = None) -> KVLayout:
    """The layout of ``arch``'s layers; a window that covers ``max_model_len`` never slides, so
    its layers count as full attention."""
    windows = layer_windows(arch)
    if max_model_len is not None:
        windows = [None if w is not None and w >= max_model_len else w for w in windows]
    return build_layout(windows, hybrid)
