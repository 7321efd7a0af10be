"""Launch configurations of the fused MoE kernels (``triton_moe``), per layer shape and batch.

A layer's shape is ``(E, H, I)``: experts, hidden size and this rank's intermediate size (after
tensor-parallel sharding). One ``MoeConfig`` covers both grouped GEMMs of a call, since they
share the expert-sorted token blocks: ``block_m`` (the rows of one block, which the alignment
pads every expert's token list to) and a tile shape for each GEMM (``w13``: gate/up with the
SiLU-and-mul epilogue, N = I, K = H; ``w2``: down, N = H, K = I).

``TUNED`` maps ``(E, H, I, M bucket)`` to measured configs; shapes without an entry take the
default of their M bucket. ``tools/bench_moe.py --tune`` prints entries in this format, to be
pasted below once measured (Qwen3-30B-A3B's are; other shapes take the untuned defaults).

A few tokens take the direct path instead (``triton_moe_gemv``: two GEMV-style kernels, no
alignment, no tensor cores); ``use_direct`` is the rule that picks it, ``DirectConfig`` its two
launch shapes (``direct_config``: ``TUNED_DIRECT``, else ``default_direct_config``), and
``configure_direct`` the hook that overrides either. ``tools/bench_moe.py --tune-direct`` prints
``TUNED_DIRECT`` entries.
"""

from __future__ import annotations

from dataclasses import dataclass

# Tokens per call, bucketed: a config tuned for a bucket serves every M up to it.
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True, slots=True)
class GemmConfig:
    block_n: int
    block_k: int
    group_m: int = 1  # M-blocks launched next to each other (they share the expert's weights)
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True, slots=True)
class MoeConfig:
    block_m: int
    w13: GemmConfig
    w2: GemmConfig

    def as_dict(self) -> dict:
        def g(c: GemmConfig) -> tuple[int, int, int, int, int]:
            return (c.block_n, c.block_k, c.group_m, c.num_warps, c.num_stages)

        return {"block_m": self.block_m, "w13": g(self.w13), "w2": g(self.w2)}

    @staticmethod
    def from_dict(d: dict) -> MoeConfig:
        return MoeConfig(d["block_m"], GemmConfig(*d["w13"]), GemmConfig(*d["w2"]))


def m_bucket(m: int) -> int:
    """The smallest bucket holding ``m`` tokens (the largest bucket beyond it)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


# (E, H, I, M bucket) -> MoeConfig.as_dict(), measured by tools/bench_moe.py --tune.
TUNED: dict[tuple[int, int, int, int], dict] = {
    # Qwen3-30B-A3B (128 experts, top-8), one H100 80GB HBM3 (tools/results/moe_tune_h100_
    # qwen3_30b_a3b.json): at T = 1 the two GEMMs took 22.5 + 9.8 us.
    (128, 2048, 768, 1): {"block_m": 16, "w13": (64, 128, 1, 4, 4), "w2": (64, 64, 8, 4, 4)},
    (128, 2048, 768, 4): {"block_m": 16, "w13": (128, 128, 8, 4, 3), "w2": (64, 128, 8, 8, 3)},
    (128, 2048, 768, 16): {"block_m": 16, "w13": (64, 128, 1, 4, 4), "w2": (64, 128, 1, 4, 4)},
    (128, 2048, 768, 64): {"block_m": 16, "w13": (128, 128, 1, 4, 3), "w2": (64, 128, 1, 4, 4)},
    (128, 2048, 768, 256): {"block_m": 32, "w13": (128, 128, 1, 8, 3),
                            "w2": (128, 128, 1, 4, 3)},
}


def default_config(m: int, num_experts: int, top_k: int) -> MoeConfig:
    """Untuned defaults by the rows an expert gets on average: few rows take narrow M blocks
    (less padding; decode is weight-bandwidth bound, so wide K tiles stream the weights), many
    rows take wide ones (compute bound: bigger tiles reuse each loaded weight more)."""
    rows_per_expert = m * top_k / num_experts
    if rows_per_expert <= 16:
        # Narrow N tiles: batch-1 decode of k experts must still spread over every SM.
        return MoeConfig(16, GemmConfig(32, 128, 1, 4, 4), GemmConfig(32, 128, 1, 4, 4))
    if rows_per_expert <= 64:
        return MoeConfig(32, GemmConfig(64, 64, 8, 4, 4), GemmConfig(64, 64, 8, 4, 4))
    if rows_per_expert <= 256:
        return MoeConfig(64, GemmConfig(128, 64, 8, 4, 3), GemmConfig(128, 64, 8, 4, 3))
    return MoeConfig(128, GemmConfig(128, 64, 8, 8, 3), GemmConfig(128, 64, 8, 8, 3))


def get_config(m: int, num_experts: int, hidden: int, intermediate: int,
               top_k: int) -> MoeConfig:
    """The launch config for ``m`` tokens through a layer of shape ``(E, H, I)``."""
    tuned = TUNED.get((num_experts, hidden, intermediate, m_bucket(m)))
    if tuned is not None:
        return MoeConfig.from_dict(tuned)
    return default_config(m, num_experts, top_k)


# --- the direct small-batch path (triton_moe_gemv) ---------------------------------------------


@dataclass(frozen=True, slots=True)
class GemvShape:
    """One direct-path kernel's launch shape: ``block_n`` output rows per program, ``block_k``
    elements of K per chunk (a few chunks are unrolled, so that all their loads can be in
    flight at once: ``triton_moe_gemv.UNROLL_MAX_CHUNKS``), ``num_warps``."""

    block_n: int
    block_k: int
    num_warps: int = 4

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.block_n, self.block_k, self.num_warps)


@dataclass(frozen=True, slots=True)
class DirectConfig:
    """The direct path's two launch shapes: ``w13`` (gate/up with SiLU-and-mul: N = I, each
    output row reading a gate and an up row, K = H) and ``w2`` (down, router weights and the
    top-k sum: N = H, K = I per slot)."""

    w13: GemvShape
    w2: GemvShape

    def as_tuple(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        return (self.w13.as_tuple(), self.w2.as_tuple())

    @staticmethod
    def from_tuple(t: tuple[tuple[int, ...], tuple[int, ...]]) -> DirectConfig:
        return DirectConfig(GemvShape(*t[0]), GemvShape(*t[1]))


# Direct when a batch has at most this many (token, slot) pairs. Each pair's program reads its
# expert's rows once; the grouped path's fixed costs (alignment, padding to block_m, the
# float32 partial rows and their sum: ~8 launches) only pay off once tokens share experts.
# Qwen3-30B-A3B on an H100 (tools/bench_moe.py --paths, the op alone, three runs): direct 29-31
# / 54-58 / 96-104 us against grouped 45-47 / 71-73 / 113-120 us at 1 / 2 / 4 tokens (8 / 16 /
# 32 pairs); at 8 tokens still 164-168 against 176, but there the duplicate rule below says
# grouped (19% of the pairs share an expert: the margin depends on the routing).
DIRECT_MAX_PAIRS = 32
# ... and while at most this fraction of its pairs are expected (uniform routing) to read an
# expert that another pair of the batch reads too: the direct path reads such an expert once
# per pair, the grouped path once (though the gate/up kernel runs the pairs of one row block
# together, so a shared expert's rows mostly come from L2 the second time). Qwen3-30B-A3B at
# T = 4: 9%; Mixtral at T = 2: 12.5%, where the H100 measured direct 461 against grouped 487 us
# on a draw without a shared expert (and 236 against 262 at T = 1): no measurement yet of
# where duplicates make the direct path lose.
DIRECT_MAX_DUPLICATE = 0.1

# (H, I, top_k, T, weight element bytes) -> DirectConfig.as_tuple(), measured by
# tools/bench_moe.py --tune-direct. Shapes without an entry take default_direct_config.
TUNED_DIRECT: dict[tuple[int, int, int, int, int], tuple[tuple[int, ...], tuple[int, ...]]] = {
    # Qwen3-30B-A3B, FP8 (e4m3) experts, one token, one H100 80GB HBM3: the op 24.3 -> 20.3 us.
    # (Its bf16 shapes, and FP8 at 2 tokens, came within 1 us of the default rule's.)
    (2048, 768, 8, 1, 1): ((8, 512, 4), (2, 256, 8)),
}

_MEASURED_DIRECT = dict(TUNED_DIRECT)
_RULE_DEFAULTS = (DIRECT_MAX_PAIRS, DIRECT_MAX_DUPLICATE)


def configure_direct(*, max_pairs: int | None = None, max_duplicate: float | None = None,
                     configs: dict[tuple[int, int, int, int, int],
                                   tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
                     reset: bool = False) -> None:
    """Override the direct path's selection rule (``max_pairs`` 0: never direct) and add to or
    replace its measured launch shapes (``configs``, ``TUNED_DIRECT``'s format); ``reset``
    first restores the shipped values. Set before a CUDA graph is captured: a captured graph
    keeps the path and shapes it was captured with."""
    global DIRECT_MAX_PAIRS, DIRECT_MAX_DUPLICATE
    if reset:
        DIRECT_MAX_PAIRS, DIRECT_MAX_DUPLICATE = _RULE_DEFAULTS
        TUNED_DIRECT.clear()
        TUNED_DIRECT.update(_MEASURED_DIRECT)
    if max_pairs is not None:
        DIRECT_MAX_PAIRS = max_pairs
    if max_duplicate is not None:
        DIRECT_MAX_DUPLICATE = max_duplicate
    if configs:
        for key, value in configs.items():
            DirectConfig.from_tuple(value)  # refuse a malformed entry now, not at launch
            TUNED_DIRECT[key] = value


def expected_duplicate(tokens: int, num_experts: int, top_k: int) -> float:
    """The fraction of a batch's ``tokens * top_k`` pairs expected to name an expert that
    another pair names too, under uniform routing (each token picks ``top_k`` distinct
    experts): ``1 - E (1 - (1 - k/E)^T) / (T k)``; 0 for one token."""
    pairs = tokens * top_k
    if pairs == 0 or tokens == 1:
        return 0.0
    frac = min(1.0, top_k / num_experts)
    distinct = num_experts * (1.0 - (1.0 - frac) ** tokens)
    return max(0.0, 1.0 - distinct / pairs)


def use_direct(tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether ``tokens`` tokens take the direct path (``DIRECT_MAX_PAIRS``,
    ``DIRECT_MAX_DUPLICATE``). Depends on the shapes alone: a CUDA graph captured for a batch
    size keeps its path."""
    return (0 < tokens * top_k <= DIRECT_MAX_PAIRS
            and expected_duplicate(tokens, num_experts, top_k) <= DIRECT_MAX_DUPLICATE)


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def direct_block_k(k: int, elem: int, max_bytes: int, min_elems: int) -> int:
    """A power-of-two K chunk of at most ``max_bytes`` of a row (at least ``min_elems``): the
    one that pads K least (masked lanes load nothing but still occupy threads), the longer of
    equals. I = 768 gives 256 (three whole chunks) rather than one 1024 chunk a quarter empty."""
    next_pow2 = 1 << max(0, k - 1).bit_length()
    hi = max(min_elems, min(_pow2_floor(max_bytes // elem), next_pow2))
    best, best_pad = hi, -(-k // hi) * hi - k
    bk = hi // 2
    while bk >= min_elems:
        pad = -(-k // bk) * bk - k
        if pad < best_pad:
            best, best_pad = bk, pad
        bk //= 2
    return best


def default_direct_config(tokens: int, hidden: int, intermediate: int, top_k: int,
                          elem: int) -> DirectConfig:
    """The untuned direct-path shapes, after ``triton_decode.gemv_config``'s pattern for
    batch-1 GEMVs (few rows per program, long K chunks, 4 warps). At Qwen3-30B-A3B's shape on
    an H100 they came within 1 us of a sweep's best in bf16 (T = 1, 2, 4) and FP8 at T = 2;
    FP8 at T = 1 has a ``TUNED_DIRECT`` entry. Gate/up: 4 rows (8 weight rows with the up
    half) x up to 4 KiB (and 2048 elements) of each row per chunk. Down: 4 rows (fewer past 8
    slots) of all k slots' experts, one chunk's tile kept to 8192 elements (its float32
    accumulator: 64 registers a thread), which at I = 768 gives 256: three whole chunks, where
    one 1024 chunk a quarter empty ran 30% slower in FP8. A chunk spans at least one 16-byte
    load per thread of the 4 warps."""
    warps = 4
    vec = max(1, 16 // elem)  # elements per 16-byte load
    slots = 1 << max(0, top_k - 1).bit_length()
    up_rows = 4
    # Each of the gate and up accumulators: at most 8192 float32 (64 registers a thread).
    gate_up = GemvShape(up_rows, direct_block_k(
        hidden, elem, min(4096, 8192 // up_rows * elem), max(16, warps * 32 * vec // up_rows)),
        warps)
    rows = max(1, min(4, 32 // slots))
    tile = max(16, 8192 // (slots * rows))  # elements of K per chunk, at most
    min_elems = min(tile, max(16, warps * 32 * vec // (slots * rows)))
    down = GemvShape(rows, direct_block_k(intermediate, elem, min(4096, tile * elem),
                                          min_elems), warps)
    return DirectConfig(gate_up, down)


def direct_config(tokens: int, hidden: int, intermediate: int, top_k: int,
                  elem: int) -> DirectConfig:
    """The direct path's launch shapes for ``tokens`` tokens of a layer ``(H, I)`` with
    ``top_k`` experts per token and weights of ``elem`` bytes per element."""
    tuned = TUNED_DIRECT.get((hidden, intermediate, top_k, tokens, elem))
    if tuned is not None:
        return DirectConfig.from_tuple(tuned)
    return default_direct_config(tokens, hidden, intermediate, top_k, elem)
