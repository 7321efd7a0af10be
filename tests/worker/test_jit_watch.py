"""The JIT compile watcher (``tidal.worker.ops.jit_watch``) and where kernels are cached.

Triton itself needs a GPU, so the hooks are driven here by stand-in ``triton`` modules shaped
like the two hook APIs the watcher supports (``triton.knobs.runtime`` on Triton >= 3.4,
``JITFunction.cache_hook`` / ``compiled_hook`` before), called the way Triton 3.6 calls them.
"""

from __future__ import annotations

import logging
import os
import sys
import types

import pytest

from tidal.worker.ops import jit_watch
from tidal.worker.ops.jit_watch import JitWatch, describe_specialization


def _fn(name: str, arg_names: list[str]) -> types.SimpleNamespace:
    """What Triton passes as ``fn`` (a JitFunctionInfo)."""
    return types.SimpleNamespace(module="tidal.worker.ops.triton_attention_kernels", name=name,
                                 jit_function=types.SimpleNamespace(arg_names=arg_names))


ATTN_ARGS = ["out_ptr", "q_ptr", "num_reqs", "num_splits", "BLOCK_M"]


def _compile_kwargs(num_reqs_type: str = "i32", divisible: bool = True, block_m: int = 128):
    """The keyword arguments of Triton 3.6's hook call for one paged-attention compile."""
    signature = {"out_ptr": "*bf16", "q_ptr": "*bf16", "num_reqs": num_reqs_type,
                 "num_splits": "constexpr", "BLOCK_M": "constexpr"}
    constants = {(3,): 1, (4,): block_m}
    if num_reqs_type == "constexpr":  # an integer argument equal to 1 becomes a constant
        constants[(2,)] = 1
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    if divisible:
        attrs[(2,)] = [["tt.divisibility", 16]]
    compile_info = {"key": "k", "signature": signature, "device": 0, "constants": constants,
                    "num_warps": 8, "num_ctas": 1, "num_stages": 2, "configs": [attrs]}
    return dict(key="k", repr="r", fn=_fn("_paged_attention_kernel", ATTN_ARGS),
                compile=compile_info, is_manual_warmup=False, already_compiled=False)


@pytest.fixture
def knobs_triton(monkeypatch):
    """A stand-in for Triton >= 3.4: hooks on ``triton.knobs.runtime``, one pre-installed by
    someone else (it must keep being called)."""
    calls: list[str] = []

    def theirs(**kwargs):
        calls.append(kwargs["key"])
        return None

    runtime = types.SimpleNamespace(jit_cache_hook=theirs, jit_post_compile_hook=None)
    fake = types.ModuleType("triton")
    fake.knobs = types.SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "triton", fake)
    return runtime, calls


def _compile(runtime, **kwargs) -> list:
    """Run the hooks as Triton does around one compile; returns what each returned."""
    args = _compile_kwargs(**kwargs)
    return [runtime.jit_cache_hook(**args), runtime.jit_post_compile_hook(**args)]


def test_without_triton_the_watcher_is_a_no_op(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    watch = JitWatch()
    assert watch.install() is False
    assert watch.install() is False  # tried once, remembered
    zero = watch.mark_ready()
    with watch.warming():
        pass
    assert watch.count == 0
    assert watch.after_ready_since(zero) == (0, [])
    watch.release()


def test_compiles_after_ready_are_warned_named_and_counted(knobs_triton, caplog):
    runtime, theirs = knobs_triton
    watch = JitWatch()
    assert watch.install() is True and watch.api == "triton.knobs.runtime"
    # Before ready: counted, never a warning.
    with caplog.at_level(logging.DEBUG, logger=jit_watch.__name__):
        assert _compile(runtime) == [None, None]  # None: Triton goes on and compiles
    assert watch.count == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert theirs == ["k"]  # the hook that was there first still runs

    zero = watch.mark_ready()
    with watch.warming():  # another engine warming up in this process: not an alarm
        _compile(runtime)
    assert watch.after_ready_since(zero) == (0, [])

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=jit_watch.__name__):
        _compile(runtime, num_reqs_type="constexpr", divisible=False, block_m=64)
        _compile(runtime, num_reqs_type="i32", divisible=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert all(w.startswith("JIT compile after ready: triton_attention_kernels."
                            "_paged_attention_kernel[") for w in warnings)
    assert "num_reqs=1," in warnings[0] and "BLOCK_M=64" in warnings[0]
    assert "num_warps=8" in warnings[0]
    assert "num_reqs:i32," in warnings[1] and "q_ptr:*bf16/16" in warnings[1]
    n, kept = watch.after_ready_since(zero)
    assert n == 2 and [e.after_ready for e in kept] == [True, True]
    assert kept[1].seconds is not None and kept[1].seconds >= 0
    assert watch.count == 4

    watch.release()  # the ready engine is gone: compiles are start-up work again
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=jit_watch.__name__):
        _compile(runtime)
    assert not caplog.records
    assert watch.after_ready_since(zero)[0] == 2


def test_a_chained_hook_may_still_skip_the_compile(knobs_triton):
    runtime, _ = knobs_triton
    runtime.jit_cache_hook = lambda **kwargs: True  # someone asks Triton to skip compiling
    watch = JitWatch()
    watch.install()
    assert runtime.jit_cache_hook(**_compile_kwargs()) is True


def test_older_triton_hooks_on_jitfunction(monkeypatch, caplog):
    """Triton < 3.4: ``JITFunction.cache_hook`` only (no after-compile hook): counted when the
    compile starts, without a duration."""
    jit_cls = type("JITFunction", (), {"cache_hook": None})
    fake = types.ModuleType("triton")
    runtime_pkg = types.ModuleType("triton.runtime")
    jit_mod = types.ModuleType("triton.runtime.jit")
    jit_mod.JITFunction = jit_cls
    monkeypatch.setitem(sys.modules, "triton", fake)
    monkeypatch.setitem(sys.modules, "triton.runtime", runtime_pkg)
    monkeypatch.setitem(sys.modules, "triton.runtime.jit", jit_mod)
    # Where the real Triton was imported, its knobs module stays cached: hide it (None in
    # sys.modules makes the import fail, as on Triton < 3.4).
    monkeypatch.setitem(sys.modules, "triton.knobs", None)
    watch = JitWatch()
    assert watch.install() is True and watch.api == "JITFunction"
    zero = watch.mark_ready()
    with caplog.at_level(logging.WARNING, logger=jit_watch.__name__):
        assert jit_cls.cache_hook(**_compile_kwargs()) is None
    n, kept = watch.after_ready_since(zero)
    assert n == 1 and kept[0].seconds is None
    assert "JIT compile after ready" in caplog.text


def test_description_survives_unexpected_hook_arguments():
    kernel, spec = describe_specialization(types.SimpleNamespace(module="m", name="k"),
                                           {"signature": 42}, fallback="raw key")
    assert kernel == "m.k" and spec == "raw key"
    kernel, spec = describe_specialization(_fn("_write_kv_kernel", ["key_ptr", "N"]),
                                           {"signature": {0: "*fp16", 1: "i32"},
                                            "constants": {"N": 1}})
    assert spec == "key_ptr:*fp16, N=1"


def test_kernel_caches_live_under_tidal_cache_dir(monkeypatch, tmp_path):
    from tidal.worker.ops import cuda_ext, kernel_cache

    for var in ("TRITON_CACHE_DIR", "TRITON_HOME", "TORCH_EXTENSIONS_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    state = kernel_cache.use_tidal_triton_cache()
    assert state.path == str(tmp_path / "triton") and state.chosen_by == "tidal"
    assert not state.warm
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")  # Triton reads it
    (tmp_path / "triton" / "abc123").mkdir(parents=True)
    monkeypatch.delenv("TRITON_CACHE_DIR")
    again = kernel_cache.use_tidal_triton_cache()
    assert again.warm and again.entries == 1 and "warm, 1 entries" in again.describe()
    assert cuda_ext.cache_root() == tmp_path / "cuda_ext"

    # The user's own choices win.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert kernel_cache.use_tidal_triton_cache().chosen_by == "TRITON_CACHE_DIR"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert cuda_ext.cache_root() == tmp_path / "ext" / "tidal"
