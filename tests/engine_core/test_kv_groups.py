"""KV groups: layers grouped by attention type, the group size g chosen within the padding-waste
bound (full-attention groups unpadded where possible, then the fewest groups), checked against a
brute-force search and real model shapes."""

from __future__ import annotations

import pytest

from tidal.engine_core.kv_groups import (
    MAX_PADDING_WASTE,
    build_layout,
    choose_group_size,
    layout_for,
    window_blocks,
)
from tidal.engine_core.model_arch import arch_from_hf_dict


def brute_force(type_sizes: list[int], full: list[bool],
                max_waste: float) -> tuple[int, int, float]:
    """(padded full-attention slots, groups, waste), the least over every g within the bound,
    written out plainly."""
    options = []
    total = sum(type_sizes)
    for g in range(1, max(type_sizes) + 1):
        groups = full_pad = 0
        for n, f in zip(type_sizes, full):
            k = (n + g - 1) // g
            groups += k
            if f:
                full_pad += k * g - n
        waste = 1 - total / (groups * g)
        if waste <= max_waste + 1e-12:
            options.append((full_pad, groups, waste))
    return min(options)


@pytest.mark.parametrize("sizes,full", [
    ([10, 52], [True, False]), ([21, 21], [True, False]), ([32], [False]), ([32], [True]),
    ([8, 40], [True, False]), ([10, 18], [True, False]), ([1, 5], [True, False]),
    ([3, 7, 11], [True, False, False]), ([1], [True]), ([7, 1, 1], [False, True, False])])
def test_group_size_choice_within_the_waste_bound(sizes, full):
    g = choose_group_size(sizes, full)
    groups = sum(-(-n // g) for n in sizes)
    waste = 1 - sum(sizes) / (groups * g)
    full_pad = sum(-(-n // g) * g - n for n, f in zip(sizes, full) if f)
    assert waste <= MAX_PADDING_WASTE + 1e-12
    assert (full_pad, groups, pytest.approx(waste)) == brute_force(sizes, full,
                                                                   MAX_PADDING_WASTE)


def _gemma3_27b() -> dict:
    # Gemma-3-27B's text config: 62 layers, every 6th global (10 global, 52 local).
    return dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                vocab_size=262208, max_position_embeddings=131072, sliding_window=1024,
                query_pre_attn_scalar=168, rope_theta=1e6, rope_local_base_freq=1e4)


def test_gemma3_27b_layout():
    arch = arch_from_hf_dict(_gemma3_27b(), "gemma3-27b")
    lay = layout_for(arch)
    windows = [arch.layer_sliding_window(i) for i in range(62)]
    assert windows.count(None) == 10
    # g = 10 (one group per 10 layers) would waste 11 %; g = 13 (five groups) 4.6 %, but in the
    # full-attention group, which holds the whole context: g = 5 pads only windowed groups.
    assert 1 - 62 / (10 * (1 + 6)) > MAX_PADDING_WASTE
    assert lay.padding_waste <= MAX_PADDING_WASTE
    assert (lay.group_size, lay.num_groups) == (5, 13)
    assert [g.window for g in lay.groups].count(None) == 2
    # Every layer in exactly one group, at its slot, with its own window.
    seen = set()
    for gi, group in enumerate(lay.groups):
        assert len(group.layers) <= lay.group_size
        for slot, layer in enumerate(group.layers):
            assert (lay.layer_group[layer], lay.layer_slot[layer]) == (gi, slot)
            assert group.window == windows[layer]
            seen.add(layer)
    assert seen == set(range(62))
    assert "padding waste" in lay.describe()


def test_gemma2_alternating_is_two_groups_without_waste():
    lay = build_layout([4096 if i % 2 == 0 else None for i in range(42)])
    assert lay.num_groups == 2 and lay.group_size == 21 and lay.padding_waste == 0
    assert lay.windows() == (None, 4096)
    assert lay.hybrid and lay.has_sliding


def test_one_type_is_one_group():
    full = build_layout([None] * 5)
    assert (full.num_groups, full.group_size, full.hybrid) == (1, 5, False)
    assert full.layer_slot == (0, 1, 2, 3, 4)
    mistral = build_layout([4096] * 32)
    assert (mistral.num_groups, mistral.hybrid, mistral.windows()) == (1, True, (4096,))


def test_disabled_or_window_covering_the_context_is_full_attention():
    arch = arch_from_hf_dict(_gemma3_27b(), "gemma3-27b")
    assert not layout_for(arch, hybrid=False).hybrid
    assert layout_for(arch, hybrid=False).group_size == 62
    # A 1024 window never slides within 1024 tokens of context.
    assert not layout_for(arch, max_model_len=1024).hybrid
    assert layout_for(arch, max_model_len=1025).hybrid


def test_blocks_per_seq():
    lay = build_layout([None, 32, None, 32])
    assert lay.group_size == 2
    bs = 8
    # A window of 32 positions (31 before the token) straddles at most 5 blocks of 8.
    assert window_blocks(32, bs) == 5
    assert max(len({p // bs for p in range(t - 31, t + 1)}) for t in range(31, 100)) == 5
    # Full group: all 13 blocks of 100 tokens; sliding: 5; plus the null block.
    assert lay.blocks_per_seq(100, bs) == 13 + 5 + 1
    # A 20-token chunk: 31 earlier positions and 20 new ones straddle up to 8 blocks.
    assert lay.blocks_per_seq(100, bs, chunk=20) == 13 + 8 + 1
    assert build_layout([None] * 3).blocks_per_seq(100, bs) == 13
