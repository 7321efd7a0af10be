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

from tidal.engine_core.lora_request import LoRARequest

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


class LoRAIds(msgspec.Struct, tag="lora_ids", **_WIRE):
    """The registered LoRA adapters' ids, ascending (a struct: a bare list cannot share the
    result union with the array-like structs)."""

    ids: list[int] = []


ControlResult = KVStats | Pong | CompileStats | LoRAIds | bool | None


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


class AddLora(msgspec.Struct, tag="add_lora", **_WIRE):
    """Register a LoRA adapter, checking its files against the base model (the workers load
    its weights on first use); False when it was registered already. A bad adapter raises
    ``LoRAAdapterError`` naming the problem; the engine is unharmed."""

    lora: LoRARequest
    result_type: ClassVar[type] = bool


class RemoveLora(msgspec.Struct, tag="remove_lora", **_WIRE):
    """Forget a LoRA adapter by id; False when it was not registered."""

    lora_int_id: int
    result_type: ClassVar[type] = bool


class ListLoras(msgspec.Struct, tag="list_loras", **_WIRE):
    """The ids of the registered LoRA adapters, ascending."""

    result_type: ClassVar[type] = LoRAIds


ControlCall = (GetKVStats | ResetPrefixCache | Ping | GetCompileStats | AddLora | RemoveLora
               | ListLoras)


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
            done = sched.kv.pool.reset_prefix_cache()
            if done and sched.connector is not None:
                done = sched.connector.reset_cache()  # the host tier's prefixes too
            return done
        case Ping():
            return Pong(engine_pid=os.getpid(), num_unfinished=sched.num_unfinished)
        case GetCompileStats():
            # Executors without workers (noop, test doubles) compile nothing.
            stats = getattr(core.executor, "compile_stats", None)
            return stats() if stats is not None else CompileStats(ready=True)
        case AddLora(lora=lora):
            return core.lora_registry.add(lora)
        case RemoveLora(lora_int_id=lora_int_id):
            return core.lora_registry.remove(lora_int_id)
        case ListLoras():
            return LoRAIds(core.lora_registry.list())
    raise TypeError(f"not a control call: {type(call).__name__}")
