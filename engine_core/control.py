"""Typed control calls: small questions and commands a frontend sends an EngineCore.

Each call is a tagged msgspec struct, and the engine dispatches on its type (``execute``), never
on a method-name string, so only the calls listed in ``ControlCall`` can ever run. Every call
names the type of its result; the clients (``AsyncLLM.control``, the multiprocess and threaded
engine clients) return that type.

They run in the EngineCore's busy loop between two steps, so they see a consistent scheduler.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, ClassVar

import msgspec

if TYPE_CHECKING:
    from tidal.engine_core.core import EngineCore

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)


# --- results ---------------------------------------------------------------------------------


class KVStats(msgspec.Struct, tag="kv_stats", **_WIRE):
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int


class Pong(msgspec.Struct, tag="pong", **_WIRE):
    engine_pid: int
    num_unfinished: int  # requests the engine holds, all frontends together


class CompileStats(msgspec.Struct, tag="compile_stats", **_WIRE):
    """Triton JIT compiles in the engine's workers (summed over ranks; see
    ``tidal.worker.ops.jit_watch``). ``after_ready`` should stay 0: every kernel specialisation
    serving meets is compiled by the start-up warm-up."""

    active: bool = False  # a compile watcher runs (a GPU worker with triton)
    ready: bool = False  # every rank finished its start-up (warm-up included)
    startup: int = 0  # compiles during start-up (profiling, graph capture, warm-up)
    after_ready: int = 0  # compiles since ready, outside any warm-up
    kernels: list[str] = []  # the newest after-ready compiles, kernel[specialisation]

    def merge(self, other: CompileStats) -> CompileStats:
        return CompileStats(
            active=self.active or other.active,
            ready=self.ready and other.ready,
            startup=self.startup + other.startup,
            after_ready=self.after_ready + other.after_ready,
            kernels=self.kernels + other.kernels,
        )


ControlResult = KVStats | Pong | CompileStats | bool | None


# --- calls -----------------------------------------------------------------------------------


class GetKVStats(msgspec.Struct, tag="get_kv_stats", **_WIRE):
    """How many KV blocks exist and are free, and how many requests run and wait."""

    result_type: ClassVar[type] = KVStats


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", **_WIRE):
    """Forget every cached prefix; False (nothing done) while any block is in use."""

    result_type: ClassVar[type] = bool


class Ping(msgspec.Struct, tag="ping", **_WIRE):
    """A round trip through the busy loop: proves it is alive and taking input."""

    result_type: ClassVar[type] = Pong


class GetCompileStats(msgspec.Struct, tag="get_compile_stats", **_WIRE):
    """How many Triton kernels the workers compiled at start-up and since ready."""

    result_type: ClassVar[type] = CompileStats


ControlCall = GetKVStats | ResetPrefixCache | Ping | GetCompileStats


def execute(core: EngineCore, call: ControlCall) -> ControlResult:
    """Run one control call against an EngineCore (in the thread that steps it)."""
    sched = core.scheduler
    match call:
        case GetKVStats():
            return KVStats(
                # Usable blocks: without the null block a hybrid pool reserves for good.
                num_blocks=sched.kv.pool.num_blocks - sched.kv.pool.num_reserved,
                num_free_blocks=sched.kv.num_free_blocks,
                num_running=len(sched.running),
                num_waiting=len(sched.waiting),
            )
        case ResetPrefixCache():
            return sched.kv.pool.reset_prefix_cache()
        case Ping():
            return Pong(engine_pid=os.getpid(), num_unfinished=sched.num_unfinished)
        case GetCompileStats():
            # Executors without workers (noop, test doubles) compile nothing.
            stats = getattr(core.executor, "compile_stats", None)
            return stats() if stats is not None else CompileStats(ready=True)
    raise TypeError(f"not a control call: {type(call).__name__}")
