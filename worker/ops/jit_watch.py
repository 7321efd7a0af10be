"""Counts the Triton JIT compiles of this process and names every one made after the engine
said it was ready.

Triton compiles a kernel once per *specialisation*: its constexpr values, the dtypes of its
pointers, whether each pointer is 16-byte aligned, and whether each integer argument equals 1
or is divisible by 16. A specialisation first met while serving stalls the whole batch for the
compile (0.3 - 2 s), so the start-up warm-up (``tidal.worker.warmup``) runs every one serving
will meet, and this watcher proves it: after ``mark_ready`` every compile outside a warm-up is
logged as a WARNING ("JIT compile after ready: ...") and counted.

It hooks Triton's compile callbacks: ``triton.knobs.runtime.jit_cache_hook`` (before a compile)
and ``jit_post_compile_hook`` (after it) on Triton 3.4 and later, ``JITFunction.cache_hook`` /
``compiled_hook`` on older ones. Both fire on a miss of Triton's in-memory kernel cache, so a
kernel loaded from the on-disk cache counts too (it still costs a load, and the disk cache may
be cold on the next machine). Hooks already installed are called after ours. Without triton
(a CPU machine) ``install`` returns False and everything else reads zero.

The watcher is process-wide (``JIT_WATCH``), like Triton's caches: several engines in one
process share it, and a compile inside any engine's warm-up is never blamed on a ready one.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# After-ready compiles whose description is kept (counts are always exact).
_KEEP_AFTER_READY = 256


@dataclass(slots=True, frozen=True)
class JitCompile:
    seq: int  # 0-based, in compile order within this process
    kernel: str  # module.function
    specialization: str  # argument types, alignment/divisibility, constexprs, launch options
    seconds: float | None  # None where the Triton version has no after-compile hook
    after_ready: bool

    def describe(self) -> str:
        took = "" if self.seconds is None else f" in {self.seconds * 1e3:.0f} ms"
        return f"{self.kernel}[{self.specialization}]{took}"


def _param_index(key: Any, names: list[str]) -> int | None:
    """Triton keys parameters by path tuple (3.3+), by index, or by name (older)."""
    if isinstance(key, tuple) and key and isinstance(key[0], int):
        return key[0]
    if isinstance(key, int):
        return key
    if isinstance(key, str) and key in names:
        return names.index(key)
    return None


def describe_specialization(fn: Any, compile_info: Mapping[str, Any] | None,
                            fallback: str = "") -> tuple[str, str]:
    """(kernel name, specialisation) of one compile, from the hook's ``fn`` and ``compile``
    arguments: ``name=value`` for constexprs (and integers specialised to 1), ``name:type``
    with ``/16`` where Triton assumes 16-divisibility or alignment, then the launch options."""
    kernel = f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}"
    kernel = kernel.removeprefix("tidal.worker.ops.")
    try:
        info = dict(compile_info or {})
        jit = getattr(fn, "jit_function", None)
        names = list(getattr(jit, "arg_names", None) or [])
        sig = info.get("signature") or {}
        types: dict[int, str] = {}
        for k, v in sig.items():
            i = _param_index(k, names)
            if i is not None:
                types[i] = str(v)
        consts: dict[int, Any] = {}
        for k, v in (info.get("constants") or {}).items():
            i = _param_index(k, names)
            if i is not None:
                consts[i] = getattr(v, "value", v)
        divisible: set[int] = set()
        configs = info.get("configs") or []
        attrs = configs[0] if configs else {}
        if isinstance(attrs, Mapping):
            for k, v in attrs.items():
                i = _param_index(k, names)
                if i is not None and "divisibility" in str(v):
                    divisible.add(i)
        parts = []
        for i in sorted(set(types) | set(consts)):
            name = names[i] if i < len(names) else f"arg{i}"
            if i in consts:
                parts.append(f"{name}={consts[i]}")
            else:
                parts.append(f"{name}:{types[i]}" + ("/16" if i in divisible else ""))
        opts = [f"{k}={info[k]}" for k in ("num_warps", "num_stages") if k in info]
        spec = ", ".join(parts + opts)
        return kernel, spec or fallback
    except Exception:  # noqa: BLE001 - a description must never break a compile
        return kernel, fallback


class JitWatch:
    """Compile counter and post-ready alarm for this process (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()  # compile start times, per launching thread
        self.installed: bool | None = None  # None: install() not tried yet
        self.api = ""  # which hook API was found
        self._count = 0
        self._after_ready = 0  # compiles made while some engine was ready and none warming
        self._recent: deque[JitCompile] = deque(maxlen=_KEEP_AFTER_READY)
        self._ready_owners = 0
        self._warming = 0
        self._prev_pre: Any = None
        self._prev_post: Any = None

    # --- installing -------------------------------------------------------------------------

    def install(self) -> bool:
        """Hook Triton's compile callbacks (once per process); False when triton is missing
        or offers no hook."""
        with self._lock:
            if self.installed is not None:
                return self.installed
            self.installed = self._install()
            return self.installed

    def _install(self) -> bool:
        try:
            triton = importlib.import_module("triton")
        except Exception as exc:  # noqa: BLE001 - absent or broken: nothing to watch
            logger.debug("JIT compile watcher off: triton does not import (%s)", exc)
            return False
        knobs = getattr(triton, "knobs", None)
        if knobs is None:
            try:
                knobs = importlib.import_module("triton.knobs")
            except Exception:  # noqa: BLE001 - Triton < 3.4: hooks on JITFunction
                knobs = None
        runtime = getattr(knobs, "runtime", None)
        if runtime is not None and hasattr(runtime, "jit_cache_hook"):
            self._hook(runtime, "jit_cache_hook", "jit_post_compile_hook")
            self.api = "triton.knobs.runtime"
            return True
        try:
            jit_cls = importlib.import_module("triton.runtime.jit").JITFunction
        except Exception as exc:  # noqa: BLE001
            logger.warning("JIT compile watcher off: no compile hook in this triton (%s)", exc)
            return False
        if not hasattr(jit_cls, "cache_hook"):
            logger.warning("JIT compile watcher off: triton %s has no compile hook",
                           getattr(triton, "__version__", "?"))
            return False
        self._hook(jit_cls, "cache_hook", "compiled_hook")
        self.api = "JITFunction"
        return True

    def _hook(self, owner: Any, pre: str, post: str) -> None:
        """Chain our hooks in front of ``owner``'s: the pre-compile one, and the post-compile
        one where this Triton has it (else the pre-compile hook counts alone)."""
        has_post = hasattr(owner, post)
        self._prev_pre = getattr(owner, pre)
        setattr(owner, pre, self._pre_hook if has_post else self._only_hook)
        if has_post:
            self._prev_post = getattr(owner, post)
            setattr(owner, post, self._post_hook)

    # --- the hooks (called by Triton, in the thread that launches the kernel) ---------------

    def _pre_hook(self, **kwargs: Any) -> Any:
        self._local.start = time.perf_counter()
        prev = self._prev_pre
        # A true result would make Triton skip the compile: only a hook we chain may say so.
        return prev(**kwargs) if prev is not None else None

    def _post_hook(self, **kwargs: Any) -> Any:
        start = getattr(self._local, "start", None)
        self._local.start = None
        seconds = None if start is None else time.perf_counter() - start
        self._record(kwargs, seconds)
        prev = self._prev_post
        return prev(**kwargs) if prev is not None else None

    def _only_hook(self, **kwargs: Any) -> Any:
        """Triton without an after-compile hook: count at the start of the compile."""
        self._record(kwargs, None)
        prev = self._prev_pre
        return prev(**kwargs) if prev is not None else None

    def _record(self, kwargs: Mapping[str, Any], seconds: float | None) -> None:
        kernel, spec = describe_specialization(kwargs.get("fn"), kwargs.get("compile"),
                                               str(kwargs.get("repr") or kwargs.get("key")))
        with self._lock:
            after = self._ready_owners > 0 and self._warming == 0
            event = JitCompile(self._count, kernel, spec, seconds, after)
            self._count += 1
            if after:
                self._after_ready += 1
                self._recent.append(event)
        if after:
            logger.warning("JIT compile after ready: %s", event.describe())
        else:
            logger.debug("JIT compile: %s", event.describe())

    # --- engines ----------------------------------------------------------------------------

    @property
    def count(self) -> int:
        """Compiles seen in this process so far."""
        return self._count

    @property
    def after_ready_count(self) -> int:
        return self._after_ready

    def mark_ready(self) -> int:
        """An engine (worker) is ready: compiles from now on, outside warm-ups, are alarms.
        Returns the after-ready count so far, the caller's zero point."""
        with self._lock:
            self._ready_owners += 1
            return self._after_ready

    def release(self) -> None:
        """A ready engine (worker) shut down."""
        with self._lock:
            self._ready_owners = max(0, self._ready_owners - 1)

    @contextmanager
    def warming(self) -> Iterator[None]:
        """Compiles inside this block are start-up work, whatever else is ready."""
        with self._lock:
            self._warming += 1
        try:
            yield
        finally:
            with self._lock:
                self._warming -= 1

    def after_ready_since(self, zero: int) -> tuple[int, list[JitCompile]]:
        """After-ready compiles since ``zero`` (a ``mark_ready`` result): their count and the
        descriptions still kept (the newest ``_KEEP_AFTER_READY``)."""
        with self._lock:
            n = self._after_ready - zero
            kept = list(self._recent)[-n:] if n > 0 else []
        return n, kept


# Triton's kernel caches are per process, so is the watcher; it holds no engine state.
JIT_WATCH = JitWatch()
