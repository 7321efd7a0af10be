"""The engine config's compilation section: ``--compilation-config`` (vLLM's field names) and
the ``-O<n>`` shorthand, validated once into a frozen ``CompilationConfig``.

``mode`` (``level`` is accepted for it, as vLLM's older name):

- 0: no compilation, the model runs eagerly (the default on every device: no GPU
  measurement has chosen otherwise yet, README: torch.compile);
- 3: the model's forward traced once by Dynamo with a dynamic token count, split at the
  attention op, and every piece between two attention calls compiled by Inductor
  (``tidal.worker.compilation``), cached on disk under ``cache_dir``.

Modes 1 and 2 (vLLM's plain ``torch.compile`` and trace-once without Inductor) are refused as
not supported. ``cudagraph_mode``: NONE (no CUDA graphs); FULL (the whole-model graphs of
decode and small mixed steps; with mode 3 they capture the compiled forward, pieces and
attention op together); PIECEWISE (mode 3 on a GPU: every compiled piece captured as a CUDA
graph per capture size, the attention run eagerly between them, so prefill, decode and mixed
steps all replay graphs: ``tidal.worker.compilation.piecewise_graphs``); FULL_AND_PIECEWISE
(decode steps and mixed steps up to ``max_mixed_cudagraph_tokens`` replay whole-model graphs
of the compiled forward, as FULL does, since tidal's Triton attention plans a mixed batch from
its counts alone; larger steps replay piecewise graphs. vLLM's FULL_AND_PIECEWISE sends every
mixed step to the piecewise graphs, whose eager attention between pieces cost Qwen3-0.6B's
528-token mixed step 1.6x on an H100). ``cudagraph_capture_sizes`` (token counts; by default
vLLM's grid: 1, 2, 4, 8, then every 8 to 256 and every 16 beyond, up to 512 or the step's
token budget; under FULL_AND_PIECEWISE only sizes above the whole-model mixed graphs' largest
step, so by default none) sizes the piecewise graphs only;
a CPU, ``enforce_eager`` or mode 0 with a piecewise mode is refused (``check_combination``), as
is ``compile_sizes`` (one compile serves every size). ``backend``: "inductor", or "eager"
(the split graph runs uncompiled: for debugging a trace). ``pass_config.enable_fusion``: the
fusion of the residual add with the RMSNorm after it and of SiLU with its multiply, which
Inductor does as it lowers the pieces (tests/worker/test_compile.py reads the kernels of the
saved pieces); no custom FX pass is needed for them, and they cannot be turned off, so false
is refused. ``custom_ops`` (vLLM's list: "all", "none", "+rms_norm", "-silu_and_mul", ...;
default none): the fused ops (``CUSTOM_OPS``) kept inside the compiled graph as opaque custom
ops that run the kernel policy's hand-written kernels (``tidal.worker.compilation.custom_ops``)
instead of torch ops that Inductor fuses.

A bad key or value is a ``ConfigError`` naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from tidal.engine_core import envs

MODES = {0: "none", 3: "piecewise"}
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE")
BACKENDS = ("inductor", "eager")
PIECEWISE_MODES = ("PIECEWISE", "FULL_AND_PIECEWISE")
MAX_CAPTURE_SIZE = 8192  # tokens of one piecewise graph (a bound on what the JSON may ask)
# The hand-written fused ops that ``custom_ops`` can keep inside the compiled graph, as opaque
# ``tidal::`` custom ops running the kernel policy's own kernels (worker/compilation/custom_ops).
CUSTOM_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul",
              "gemma_rms_norm", "gemma_add_norm_norm", "rotary_embedding")
_UNSUPPORTED_MODES = {
    1: "mode 1 (plain torch.compile of the whole model)",
    2: "mode 2 (Dynamo trace once, without Inductor)",
}


class PassConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Inductor fuses the elementwise neighbours of every matmul (the residual add with the
    # RMSNorm after it, SiLU with the multiply) as it lowers a piece; always on.
    enable_fusion: bool = True


class CompilationConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    mode: int = 0
    cudagraph_mode: str | None = None  # None: FULL on a GPU (unless enforce_eager), NONE on CPU
    # Token counts of the piecewise graphs, ascending (None: the default for max_num_seqs).
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    backend: str = "inductor"
    cache_dir: str | None = None  # resolved: envs.cache_dir() / "compile" unless given
    pass_config: PassConfig = msgspec.field(default_factory=PassConfig)
    # Resolved from vLLM's list ("all", "none", "+name", "-name"): the fused ops kept as the
    # hand-written kernels inside the graph; the others are torch ops that Inductor fuses.
    custom_ops: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.mode == 3

    @property
    def piecewise(self) -> bool:
        """Whether the compiled pieces replay CUDA graphs (PIECEWISE, FULL_AND_PIECEWISE)."""
        return self.enabled and self.cudagraph_mode in PIECEWISE_MODES


def _error(message: str) -> Exception:
    from tidal.engine_core.config import ConfigError  # config.py imports this module

    return ConfigError(message)


def default_cache_dir() -> str:
    return str(envs.cache_dir() / "compile")


def _custom_ops(raw: Any) -> tuple[str, ...]:
    """vLLM's ``custom_ops`` list resolved to op names: "all" / "none" set the start (default
    none: Inductor generates the fused kernels), then "+name" adds and "-name" removes, in
    order."""
    if isinstance(raw, str) or not isinstance(raw, (list, tuple)) or \
            not all(isinstance(e, str) for e in raw):
        raise _error(f"compilation_config.custom_ops must be a list of strings (\"all\", "
                     f"\"none\", \"+name\", \"-name\"), got {raw!r}")
    chosen: set[str] = set()
    for entry in raw:
        if entry in ("all", "none"):
            chosen = set(CUSTOM_OPS) if entry == "all" else set()
            continue
        name = entry[1:]
        if entry[:1] not in "+-" or name not in CUSTOM_OPS:
            raise _error(f"compilation_config.custom_ops: {entry!r} is not \"all\", \"none\" "
                         f"or +/- one of {', '.join(CUSTOM_OPS)}")
        if entry[0] == "+":
            chosen.add(name)
        else:
            chosen.discard(name)
    return tuple(op for op in CUSTOM_OPS if op in chosen)


def _int_field(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(f"compilation_config.{name} must be an integer, got {value!r}")
    return value


def _capture_sizes(raw: Any, cudagraph_mode: str | None) -> tuple[int, ...] | None:
    """``cudagraph_capture_sizes`` checked: positive token counts up to ``MAX_CAPTURE_SIZE``,
    for a piecewise mode only (the whole-model graphs take theirs from max_num_seqs)."""
    if not isinstance(raw, (list, tuple)):
        raise _error(f"compilation_config.cudagraph_capture_sizes must be a list of token "
                     f"counts, got {raw!r}")
    if not raw:  # vLLM's spelling of "the default"
        return None
    if cudagraph_mode not in PIECEWISE_MODES:
        raise _error("compilation_config.cudagraph_capture_sizes: not yet supported with "
                     f"cudagraph_mode {cudagraph_mode or 'FULL (the default)'} (the whole-model "
                     "graphs take their sizes from max_num_seqs); it sizes the PIECEWISE graphs")
    if len(raw) > 512:
        raise _error(f"compilation_config.cudagraph_capture_sizes: at most 512 sizes, got "
                     f"{len(raw)}")
    for value in raw:
        if isinstance(value, bool) or not isinstance(value, int) \
                or not 1 <= value <= MAX_CAPTURE_SIZE:
            raise _error(f"compilation_config.cudagraph_capture_sizes: each must be an integer "
                         f"in 1..{MAX_CAPTURE_SIZE}, got {value!r}")
    return tuple(sorted(set(raw)))


def build_compilation_config(raw: Mapping[str, Any] | int | str | None) -> CompilationConfig:
    """The section from ``--compilation-config`` (a JSON object, its text, or a bare level as
    ``-O3`` gives) or None (the defaults)."""
    if isinstance(raw, str):
        text = raw.strip()
        if text.isdigit():
            raw = int(text)
        else:
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as exc:
                raise _error(f"compilation_config is not valid JSON: {exc}") from None
    if raw is None:
        raw = {}
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = {"mode": raw}
    if not isinstance(raw, Mapping):
        raise _error(f"compilation_config must be a JSON object or a level 0-3, got {raw!r}")
    values = dict(raw)
    if "level" in values:
        if "mode" in values and values["mode"] != values["level"]:
            raise _error("compilation_config: give mode or level (its older name), not both")
        values["mode"] = values.pop("level")
    mode = _int_field("mode", values.get("mode", 0))
    if mode in _UNSUPPORTED_MODES:
        raise _error(f"compilation_config.mode: not yet supported: {_UNSUPPORTED_MODES[mode]}; "
                     "use 3 (piecewise: Dynamo + Inductor, split at attention) or 0 (eager)")
    if mode not in MODES:
        raise _error(f"compilation_config.mode must be 0 or 3 (or 1, 2: not yet supported), "
                     f"got {mode}")
    values["mode"] = mode
    cg = values.get("cudagraph_mode")
    if cg is not None:
        if not isinstance(cg, str) or cg.upper() not in CUDAGRAPH_MODES:
            raise _error(f"compilation_config.cudagraph_mode must be one of "
                         f"{', '.join(CUDAGRAPH_MODES)}, got {cg!r}")
        cg = cg.upper()
        if cg in PIECEWISE_MODES and mode != 3:
            raise _error(f"compilation_config.cudagraph_mode {cg} needs mode 3 (the graphs are "
                         "captured around the compiled pieces)")
        values["cudagraph_mode"] = cg
    sizes = values.pop("cudagraph_capture_sizes", None)
    if sizes is not None:
        values["cudagraph_capture_sizes"] = _capture_sizes(sizes, cg)
    if values.get("compile_sizes"):
        raise _error("compilation_config.compile_sizes: not yet supported (the pieces compile "
                     "once, with a symbolic token count, for every size)")
    values.pop("compile_sizes", None)
    backend = values.get("backend", "inductor")
    if backend not in BACKENDS:
        raise _error(f"compilation_config.backend must be one of {', '.join(BACKENDS)}, "
                     f"got {backend!r}")
    cache_dir = values.get("cache_dir")
    if cache_dir is not None and (not isinstance(cache_dir, str) or not cache_dir.strip()):
        raise _error(f"compilation_config.cache_dir must be a folder path, got {cache_dir!r}")
    values["cache_dir"] = cache_dir or default_cache_dir()
    values["custom_ops"] = _custom_ops(values.get("custom_ops", ()))
    if values["custom_ops"] and mode != 3:
        raise _error("compilation_config.custom_ops needs mode 3 (without compilation every "
                     "fused op runs the kernel policy's hand-written kernel already; "
                     "--ops-backend chooses those)")
    passes = values.get("pass_config")
    if passes is not None and not isinstance(passes, Mapping):
        raise _error(f"compilation_config.pass_config must be a JSON object, got {passes!r}")
    try:
        values["pass_config"] = msgspec.convert(dict(passes or {}), PassConfig)
        cc = msgspec.convert(values, CompilationConfig)
    except msgspec.ValidationError as exc:
        raise _error(f"compilation_config: {exc}") from None
    if not cc.pass_config.enable_fusion:
        raise _error("compilation_config.pass_config.enable_fusion: not yet supported: false "
                     "(Inductor fuses the residual add + RMSNorm and SiLU-and-mul as it lowers "
                     "each piece; there is no switch to keep them apart)")
    return cc


def describe(cc: CompilationConfig, device: str) -> str:
    """The start-up log's line for the section as resolved."""
    graphs = cc.cudagraph_mode or ("FULL" if device == "cuda" else "NONE")
    if not cc.enabled:
        return (f"off (mode 0: eager, the default on every device until GPU measurements "
                f"choose otherwise); cudagraph_mode {graphs}")
    fusion = ("; add + RMSNorm and SiLU-and-mul fused" if cc.backend == "inductor"
              and not {"fused_add_rms_norm", "silu_and_mul"} & set(cc.custom_ops) else "")
    if cc.custom_ops:
        fusion += f"; hand-written kernels kept as custom ops: {', '.join(cc.custom_ops)}"
    how = {"PIECEWISE": "every piece a graph per capture size, attention eager between them",
           "FULL_AND_PIECEWISE": "decode and mixed steps up to max_mixed_cudagraph_tokens "
                                 "replay whole-model graphs, larger steps piecewise ones "
                                 "of the capture sizes above that",
           "NONE": "no graphs"}.get(graphs, "on a GPU the whole-model graphs capture the "
                                            "compiled forward")
    sizes = (f", capture sizes {list(cc.cudagraph_capture_sizes)}"
             if cc.cudagraph_capture_sizes else "")
    return (f"mode 3 (Dynamo trace once, dynamic token count, split at attention, pieces "
            f"compiled by {cc.backend}{fusion}); cudagraph_mode {graphs} ({how}{sizes}); "
            f"cache {cc.cache_dir}")


def check_combination(cc: CompilationConfig, *, task: str, pipeline_parallel_size: int,
                      device: str = "cuda", enforce_eager: bool = False,
                      max_num_tokens: int | None = None) -> None:
    """Refuse what the compiled model does not do yet (mode 3 only), naming it.
    ``max_num_tokens``: the most tokens a step holds (no capture size may exceed it)."""
    if not cc.enabled:
        return
    if cc.piecewise:
        # Refused, not dropped: a CPU has no CUDA graphs, and enforce_eager asks for none.
        if device != "cuda":
            raise _error(f"compilation_config.cudagraph_mode {cc.cudagraph_mode} needs a CUDA "
                         f"device (device {device!r}); use NONE")
        if enforce_eager:
            raise _error(f"compilation_config.cudagraph_mode {cc.cudagraph_mode} with "
                         "enforce_eager: pick one (enforce_eager means no CUDA graphs)")
        sizes = cc.cudagraph_capture_sizes
        if sizes and max_num_tokens is not None and sizes[-1] > max_num_tokens:
            raise _error(f"compilation_config.cudagraph_capture_sizes: {sizes[-1]} is above "
                         f"the {max_num_tokens} tokens a step can hold (max_num_batched_tokens "
                         "/ max_num_seqs)")
    refused = []
    if task != "generate":
        refused.append(f"task {task!r} (the compiled forward is the decoder's)")
    if pipeline_parallel_size > 1:
        refused.append("pipeline parallelism (a stage's forward takes and returns the "
                       "intermediate tensors, which the trace does not)")
    if refused:
        raise _error("compilation_config.mode 3: not yet supported with " + "; ".join(refused)
                     + "; use mode 0")
