"""Launch configurations of the fused MoE kernels (``triton_moe``), per layer shape and batch.

A layer's shape is ``(E, H, I)``: experts, hidden size and this rank's intermediate size (after
tensor-parallel sharding). One ``MoeConfig`` covers both grouped GEMMs of a call, since they
share the expert-sorted token blocks: ``block_m`` (the rows of one block, which the alignment
pads every expert's token list to) and a tile shape for each GEMM (``w13``: gate/up with the
SiLU-and-mul epilogue, N = I, K = H; ``w2``: down, N = H, K = I).

``TUNED`` maps ``(E, H, I, M bucket)`` to measured configs; shapes without an entry take the
default of their M bucket. ``tools/bench_moe.py --tune`` prints entries in this format, to be
pasted below once measured (Qwen3-30B-A3B's are; other shapes take the untuned defaults).
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
