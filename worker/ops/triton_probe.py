"""Time stamps from inside Triton kernels, for the decode-chain timelines of
``tools/bench_decode_chain.py``: where a program spends the microseconds between its launch, its
dependent-launch wait and its last store, which a profiler's kernel start and end cannot show.

A kernel built with its ``TIMES`` constexpr off compiles none of this. Stamps are the GPU's
``%globaltimer`` (nanoseconds, one clock for every SM). It ticks every 256 ns on the H100 and
H200, so the tool takes medians over many layers and replays. A stamp that waits for a value
reduces it first, and those reductions add 1.3-1.9 us to a stamped layer.
"""

from __future__ import annotations

import triton
import triton.language as tl

STAMPS = 8  # int64 slots per program in a times buffer


@triton.jit
def now_after(dep):
    """``%globaltimer`` read once ``dep`` (a scalar, or any value reduced to one) is
    available: the stamp cannot be taken before the loads that produce ``dep`` have landed."""
    d = dep.to(tl.float32).to(tl.int32, bitcast=True)
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer; // $1", "=l,r", [d], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def stamp(times_ptr, program, slot, dep):
    """Store the time ``dep`` became available into ``times[program, slot]``."""
    tl.store(times_ptr + program.to(tl.int64) * 8 + slot, now_after(dep))  # 8: STAMPS
