"""A warm start without Dynamo: the compiled model rebuilt from the compile cache alone.

Dynamo's trace of a decoder takes seconds and gives the same graph every time for the same
cache key. So the first (cold) start records, next to the pieces, a *plan* of the split graph
(``WarmPlan``, ``warm.json`` in the cache entry): the split forward's Python code (it only
calls its submodules in order and unpacks their outputs), each submodule either a compiled
piece (its cache key) or an attention call (its few lines of code), where each of the
forward's arguments comes from (a model parameter or buffer by its attribute path, the
``input_ids`` / ``positions`` tensors, or their length) and how the graph's outputs make the
model's ``(hidden, residual)``. A later start with the same key loads every piece and runs the
plan's code directly: no Dynamo trace (``CompileStats.dynamo_traces`` stays 0).

The cold start checks a plan before saving it: rebuilt from the file, it must give the Dynamo
forward's outputs on the start-up's dummy step. A warm start that cannot use its plan (a piece
missing or corrupt, an attribute path that no longer resolves) falls back to the trace.

The plan's code is executed as Python, like the pieces (``CompiledArtifact.load`` unpickles):
the cache folder is trusted local state, written by this engine, never received over a socket.
So a plan runs only from an entry folder and file that this user owns and that neither the
group nor others may write (``untrusted``); a cache under a shared folder such as ``/tmp``
that fails this is traced instead, with a warning naming why.
Dynamo's guards are not re-checked on the warm path: the cache key already covers what they
guard here (the model's architecture and dtype, the kernel policy, the versions), and the
runner calls the forward one way (inference mode, int64 ids and positions on the device).
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import os
import re
import stat
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import fx, nn

from tidal.worker.compilation.attention_op import is_attention_node

logger = logging.getLogger(__name__)

PLAN = "warm.json"
FORMAT_VERSION = 1

_ROOT = re.compile(r"^L\['(\w+)'\]")
_STEP = re.compile(r"\.(\w+)|\['([^'\]]*)'\]")


class ArgSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """Where one argument of the split forward comes from. ``kind``: "input" (``name`` is
    input_ids or positions), "length" (that tensor's length), "attr" (``path``: getattr /
    getitem steps from the model)."""

    kind: str
    name: str = ""
    path: tuple[tuple[str, str], ...] = ()
    # An "attr" tensor's shape, strides and dtype when traced: the pieces were compiled for
    # them (a longer max_model_len, say, grows the rotary cache but not the cache key).
    layout: str = ""


class SubSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """One submodule of the split graph: a compiled piece (``key`` in the cache, ``single``:
    it returns one value, ``fed``: its arguments that attention outputs) or an attention call
    (``code`` and the ``imports`` it needs)."""

    name: str
    kind: str  # "piece" | "attention"
    key: str = ""
    single: bool = False
    fed: tuple[int, ...] = ()
    code: str = ""
    imports: str = ""


class WarmPlan(msgspec.Struct, frozen=True):
    format: int
    # (file, sha256) of every source file Dynamo traced: a changed model or layer file
    # (without a version bump: a checkout) makes the plan stale, so the next start traces.
    sources: tuple[tuple[str, str], ...]
    args: tuple[ArgSpec, ...]
    forward: str  # the split graph's forward source
    imports: str
    subs: tuple[SubSpec, ...]
    outputs: tuple[int, ...]  # per element of the model's result: graph output index, -1: None


def _arg_spec(source_name: str) -> ArgSpec | None:
    m = _ROOT.match(source_name)
    if m is None:
        return None
    root, rest = m.group(1), source_name[m.end():]
    if root in ("input_ids", "positions"):
        if rest == "":
            return ArgSpec("input", root)
        if rest == ".size()[0]":
            return ArgSpec("length", root)
        return None
    if root != "model":
        return None
    path = []
    pos = 0
    for step in _STEP.finditer(rest):
        if step.start() != pos:
            return None
        pos = step.end()
        path.append(("attr", step.group(1)) if step.group(1) is not None
                    else ("item", step.group(2)))
    if pos != len(rest):
        return None
    return ArgSpec("attr", "model", tuple(path))


def _layout(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return f"{type(t).__name__}"
    return f"{tuple(int(x) for x in t.shape)}{tuple(int(x) for x in t.stride())}{t.dtype}"


def _imports(gm: fx.GraphModule) -> str:
    from torch.fx.graph_module import _format_import_block
    from torch.package import sys_importer

    return _format_import_block(gm.graph.python_code("self").globals, sys_importer)


def record(gm: fx.GraphModule, split: fx.GraphModule, pieces: Sequence[str],
           keys: dict[str, str], singles: dict[str, bool],
           fed: dict[str, frozenset[int]]) -> WarmPlan | None:
    """The plan of a traced and split forward, or None (with a debug line) when something in
    it is not one this module knows how to rebuild (its outputs are matched to the model's
    result by ``finish``)."""
    args = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        grapharg = node.meta.get("grapharg")
        spec = _arg_spec(grapharg.source.name) if grapharg is not None else None
        if spec is None:
            logger.debug("warm start: argument %s from %s is not rebuildable", node.name,
                         getattr(grapharg, "source", None))
            return None
        if spec.kind == "attr":
            example = node.meta.get("example_value")
            if not isinstance(example, torch.Tensor):
                return None
            spec = msgspec.structs.replace(spec, layout=_layout(example))
        args.append(spec)
    split_args = [n.target for n in split.graph.nodes if n.op == "placeholder"]
    gm_args = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    if split_args != gm_args:
        return None
    subs = []
    for name, sub in split.named_children():
        if name in pieces:
            if name not in keys:
                return None
            subs.append(SubSpec(name, "piece", key=keys[name], single=singles[name],
                                fed=tuple(sorted(fed.get(name, ())))))
        elif isinstance(sub, fx.GraphModule) \
                and sum(is_attention_node(n) for n in sub.graph.nodes) == 1:
            subs.append(SubSpec(name, "attention", code=sub.code, imports=_imports(sub)))
        else:
            return None
    sources = traced_sources()
    if not sources:
        return None
    return WarmPlan(FORMAT_VERSION, sources, tuple(args), split.code, _imports(split),
                    tuple(subs), ())


def untrusted(entry: Path, plan_file: Path) -> str | None:
    """Why the plan ``plan_file`` of the cache entry folder ``entry`` must not be executed, or
    None: both must be this user's (not links) and writable by nobody else, since whoever can
    write them chooses the code this process runs."""
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    for path in (entry, plan_file):
        try:
            st = os.lstat(path)
        except OSError as exc:
            return f"cannot inspect {path}: {exc.strerror or exc}"
        if stat.S_ISLNK(st.st_mode):
            return f"{path} is a symbolic link"
        if uid is not None and st.st_uid != uid:
            return f"{path} belongs to user id {st.st_uid}, not to this user ({uid})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return (f"{path} may be written by its group or others (mode "
                    f"{stat.S_IMODE(st.st_mode):o})")
    return None


def _file_sha256(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def traced_sources() -> tuple[tuple[str, str], ...]:
    """The files of the code Dynamo traced for the graph being compiled (call inside a
    backend), with their hashes; empty when Dynamo does not say."""
    ctx = torch._guards.TracingContext.try_get()
    files = sorted({c.co_filename for c in (getattr(ctx, "traced_code", None) or ())})
    out = []
    for f in files:
        digest = _file_sha256(f)
        if digest is None:
            return ()
        out.append((f, digest))
    return tuple(out)


def graph_outputs(split: fx.GraphModule) -> int:
    """How many values the split graph returns."""
    out = next(n for n in reversed(split.graph.nodes) if n.op == "output")
    value = out.args[0]
    return len(value) if isinstance(value, (tuple, list)) else 1


def finish(plan: WarmPlan, result: Any, graph_outputs: int) -> WarmPlan | None:
    """Match the model's result (a tuple, None where the forward returns a constant None) to
    the graph's ``graph_outputs`` outputs, in order."""
    if not isinstance(result, tuple):
        return None
    outputs, j = [], 0
    for r in result:
        if r is None:
            outputs.append(-1)
        elif isinstance(r, torch.Tensor) and j < graph_outputs:
            outputs.append(j)
            j += 1
        else:
            return None
    if j != graph_outputs:
        return None
    return msgspec.structs.replace(plan, outputs=tuple(outputs))


def _exec(code: str, imports: str, name: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    exec(compile(imports, f"<warm {name} imports>", "exec"), namespace)  # noqa: S102
    exec(compile(code, f"<warm {name}>", "exec"), namespace)  # noqa: S102
    return namespace["forward"]


def _resolve(model: nn.Module, path: Sequence[tuple[str, str]]) -> Any:
    obj: Any = model
    for how, what in path:
        obj = getattr(obj, what) if how == "attr" else obj[what]
    return obj


class _Call(nn.Module):
    """A submodule of the rebuilt split graph whose forward is the plan's code."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.forward = types.MethodType(fn, self)  # type: ignore[method-assign]


class WarmForward:
    """The compiled forward rebuilt from a plan: ``(input_ids, positions) -> result``."""

    def __init__(self, plan: WarmPlan, root: nn.Module, fixed: list[Any]) -> None:
        self.plan = plan
        self.root = root
        self._forward = types.MethodType(_exec(plan.forward, plan.imports, "forward"), root)
        self._fixed = fixed  # per argument: the tensor, or None (filled per call)
        self._dynamic = [(i, a.kind, a.name) for i, a in enumerate(plan.args)
                         if a.kind != "attr"]
        self._get = [operator.itemgetter(j) if j >= 0 else None for j in plan.outputs]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[Any, ...]:
        args = list(self._fixed)
        inputs = {"input_ids": input_ids, "positions": positions}
        for i, kind, name in self._dynamic:
            t = inputs[name]
            args[i] = t if kind == "input" else t.shape[0]
        out = self._forward(*args)
        if not isinstance(out, (tuple, list)):
            out = (out,)
        return tuple(None if g is None else g(out) for g in self._get)


def build(plan: WarmPlan, model: nn.Module, load_piece: Callable[[str], Any | None],
          make_piece: Callable[[Any, SubSpec, int], nn.Module]) -> WarmForward | None:
    """``plan`` over ``model``: every piece loaded with ``load_piece(key)`` (None: missing or
    corrupt, so no warm start) and wrapped by ``make_piece(artifact, spec, index)``."""
    if plan.format != FORMAT_VERSION:
        return None
    for path, digest in plan.sources:
        if _file_sha256(path) != digest:
            logger.info("warm start: %s changed since the plan was recorded; tracing", path)
            return None
    fixed: list[Any] = []
    for a in plan.args:
        if a.kind == "attr":
            try:
                value = _resolve(model, a.path)
            except (AttributeError, KeyError, TypeError):
                logger.info("warm start: %s no longer resolves on the model", a.path)
                return None
            if _layout(value) != a.layout:
                logger.info("warm start: %s is %s, traced as %s; tracing", a.path,
                            _layout(value), a.layout)
                return None
            fixed.append(value)
        else:
            fixed.append(None)
    root = nn.Module()
    index = 0
    for sub in plan.subs:
        if sub.kind == "piece":
            artifact = load_piece(sub.key)
            if artifact is None:
                return None
            root.add_module(sub.name, make_piece(artifact, sub, index))
            index += 1
        else:
            root.add_module(sub.name, _Call(_exec(sub.code, sub.imports, sub.name)))
    return WarmForward(plan, root, fixed)


def encode(plan: WarmPlan) -> bytes:
    return json.dumps(msgspec.to_builtins(plan), indent=1).encode()


def decode(data: bytes) -> WarmPlan | None:
    try:
        return msgspec.convert(json.loads(data), WarmPlan)
    except (ValueError, msgspec.ValidationError) as exc:
        logger.warning("warm start: unreadable plan (%s); tracing instead", exc)
        return None
