"""Structural rules of the code base, checked on its syntax trees.

- Only ``engine_core/envs.py`` reads the environment; a few files may set variables (for their
  child processes or for a library that reads them), each listed with its reason.
- Model files import from ``engine_core`` only the config types.
- The arrows run frontend -> engine_core -> worker: nothing imports ``frontend`` from
  ``engine_core`` or ``worker``, and ``engine_core`` imports ``worker`` only where listed.
- The model registry is the one list of architectures, and every entry resolves.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch import nn

from tidal.engine_core.model_registry import FAMILIES, family

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine_core", "frontend", "worker")
ENVS = "engine_core/envs.py"

# Files that set (never read) environment variables, and why.
ENV_WRITERS: dict[str, str] = {
    "engine_core/cli.py": "hands --log-level on to the processes it starts as TIDAL_LOG_LEVEL",
    "engine_core/ray_executor.py": "applies WorkerArgs.env inside the Ray actor before torch "
                                   "touches a device",
    "worker/worker_proc.py": "applies WorkerArgs.env in the spawned worker before torch "
                             "touches a device",
    "worker/distributed/parallel_state.py": "points gloo at the loopback interface "
                                            "(GLOO_SOCKET_IFNAME) in its own worker process",
    "worker/ops/kernel_cache.py": "points Triton's cache at tidal's folder (TRITON_CACHE_DIR), "
                                  "which Triton reads at each compile",
    "frontend/server/api_servers.py": "sets PROMETHEUS_MULTIPROC_DIR for the API server "
                                      "processes it starts, and restores it after",
    "frontend/dp_engines.py": "gives each data-parallel rank its slice of the GPUs "
                              "(CUDA_VISIBLE_DEVICES) in the rank's own process, before CUDA "
                              "starts there",
}

# Module-level imports of worker code by engine_core, and why. Everything else of engine_core
# runs in the EngineCore / frontend processes and must not pull in torch-heavy worker modules.
ENGINE_CORE_WORKER_IMPORTS: dict[tuple[str, str], str] = {
    ("engine_core/multiproc_executor.py", "tidal.worker.shm_broadcast"):
        "the executor creates the broadcast ring its workers read",
    ("engine_core/multiproc_executor.py", "tidal.worker.worker_proc"):
        "the executor spawns worker_main and speaks its message types",
    ("engine_core/ray_executor.py", "tidal.worker.worker_proc"):
        "the Ray executor speaks the worker's message types",
}
# Files of engine_core that may import worker code inside functions (the executors, which
# start workers; the uniproc executor runs one in-process).
ENGINE_CORE_LAZY_WORKER_IMPORTERS = frozenset({
    "engine_core/executor.py",
    # The host KV tier's worker half builds its host tensors (worker/kv_transfer) in the worker.
    "engine_core/kv_transfer/offloading_connector.py",
    "engine_core/multiproc_executor.py",
    "engine_core/ray_executor.py",
})

# What a model file may import from engine_core: the config types.
MODEL_ENGINE_CORE_IMPORTS = frozenset({
    "tidal.engine_core.model_arch",
    "tidal.engine_core.model_registry",
    "tidal.engine_core.config",
})

# Calls on os.environ that only change it.
_ENV_WRITE_METHODS = frozenset({"pop", "update", "clear", "__setitem__", "__delitem__"})


def _sources() -> Iterator[tuple[str, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            yield rel, ast.parse(path.read_text(), filename=rel)


SOURCES = dict(_sources())


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _os_aliases(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name for a in node.names if a.name == "os")
    return names


@dataclass(frozen=True, slots=True)
class EnvUse:
    path: str
    line: int
    kind: str  # "read" | "write"
    text: str


def env_uses(path: str, tree: ast.Module) -> list[EnvUse]:
    """Every read and write of the process environment in one file."""
    os_names = _os_aliases(tree)
    parents = _parents(tree)
    uses: list[EnvUse] = []

    def add(node: ast.AST, kind: str) -> None:
        uses.append(EnvUse(path, getattr(node, "lineno", 0), kind, ast.unparse(node)))

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in ("environ", "environb", "getenv", "getenvb"):
                    add(node, "read")  # an alias hides every later use from this check
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in os_names):
            continue
        if node.attr in ("getenv", "getenvb"):
            add(node, "read")
        elif node.attr in ("putenv", "unsetenv"):
            add(node, "write")
        elif node.attr in ("environ", "environb"):
            parent = parents.get(node)
            if isinstance(parent, ast.Subscript) and isinstance(parent.ctx, (ast.Store, ast.Del)):
                add(parent, "write")
            elif (isinstance(parent, ast.Attribute) and parent.attr in _ENV_WRITE_METHODS
                  and isinstance(parents.get(parent), ast.Call)):
                add(parents[parent], "write")
            else:
                # ``.get``, ``[...]`` loads, ``in``, ``copy()``, ``dict(os.environ)``, aliasing.
                add(parent if parent is not None else node, "read")
    return uses


def _nested(node: ast.stmt) -> Iterator[ast.stmt]:
    for field in ("body", "orelse", "finalbody"):
        yield from (c for c in getattr(node, field, ()) if isinstance(c, ast.stmt))
    for handler in getattr(node, "handlers", ()):
        yield from handler.body


def _imports(tree: ast.Module, package: str) -> Iterator[tuple[ast.stmt, str, bool]]:
    """``(node, imported module, at module level)`` for every import of a module of
    ``package``; ``from pkg import name`` yields ``pkg.name`` (which may be a submodule).
    ``if TYPE_CHECKING:`` blocks are skipped: they never run."""

    def visit(body: Iterator[ast.stmt] | list[ast.stmt],
              module_level: bool) -> Iterator[tuple[ast.stmt, str, bool]]:
        for node in body:
            if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
                yield from visit(node.orelse, module_level)
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield node, alias.name, module_level
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against the importing module's package
                    parts = package.split(".")
                    prefix = ".".join(parts[: len(parts) - node.level + 1])
                    base = f"{prefix}.{base}" if base else prefix
                for alias in node.names:
                    yield node, f"{base}.{alias.name}", module_level
            in_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            yield from visit(_nested(node), module_level and not in_function)

    yield from visit(tree.body, True)


def _package(path: str) -> str:
    """The package a source file's relative imports resolve against."""
    module = "tidal." + path.removesuffix(".py").replace("/", ".")
    return module.removesuffix(".__init__") if path.endswith("__init__.py") else \
        module.rsplit(".", 1)[0]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# --- the checker's own tests: it must catch what it claims to ---------------------------------


def test_env_checker_classifies_reads_and_writes() -> None:
    code = """
import os
import os as o
a = os.environ.get("A")
b = os.environ["B"]
c = "C" in os.environ
d = os.getenv("D")
e = dict(o.environ)
f = os.environ.copy()
os.environ["X"] = "1"
del os.environ["Y"]
os.environ.pop("Z", None)
os.environ.update(W="1")
"""
    uses = env_uses("x.py", ast.parse(code))
    reads = sorted(u.line for u in uses if u.kind == "read")
    writes = sorted(u.line for u in uses if u.kind == "write")
    assert reads == [4, 5, 6, 7, 8, 9]
    assert writes == [10, 11, 12, 13]
    assert [u.kind for u in env_uses("y.py", ast.parse("from os import environ"))] == ["read"]


def test_import_walker_tells_module_level_from_lazy() -> None:
    code = """
import tidal.worker.a
from tidal.worker import b
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    import tidal.worker.hidden
try:
    from . import sibling
except ImportError:
    pass
class K:
    import tidal.worker.in_class
def f():
    from tidal.worker.c import d
"""
    found = [(m, top) for _, m, top in _imports(ast.parse(code), "tidal.engine_core")]
    assert ("tidal.worker.a", True) in found
    assert ("tidal.worker.b", True) in found
    assert ("tidal.engine_core.sibling", True) in found
    assert ("tidal.worker.in_class", True) in found
    assert ("tidal.worker.c.d", False) in found
    assert not any("hidden" in m for m, _ in found)


# --- the rules ------------------------------------------------------------------------------


def test_sources_found() -> None:
    assert ENVS in SOURCES and "worker/models/registry.py" in SOURCES


def test_only_envs_reads_the_environment() -> None:
    uses = [u for path, tree in SOURCES.items() for u in env_uses(path, tree)]
    reads = [f"{u.path}:{u.line}: {u.text}" for u in uses if u.kind == "read" and u.path != ENVS]
    assert not reads, "read the environment through tidal.engine_core.envs:\n" + "\n".join(reads)
    writes = [f"{u.path}:{u.line}: {u.text}" for u in uses
              if u.kind == "write" and u.path not in ENV_WRITERS]
    assert not writes, ("set the environment only where ENV_WRITERS lists (add the file with "
                        "its reason):\n" + "\n".join(writes))
    assert any(u.path == ENVS and u.kind == "read" for u in uses)


def test_env_writers_list_is_current() -> None:
    writers = {u.path for path, tree in SOURCES.items() for u in env_uses(path, tree)
               if u.kind == "write"}
    assert set(ENV_WRITERS) <= writers, f"stale ENV_WRITERS entries: {set(ENV_WRITERS) - writers}"


def test_model_files_import_only_config_types_from_engine_core() -> None:
    bad = []
    for path, tree in SOURCES.items():
        if not path.startswith("worker/models/"):
            continue
        for node, module, _ in _imports(tree, _package(path)):
            if _within(module, "tidal.engine_core") and not any(
                    _within(module, allowed) for allowed in MODEL_ENGINE_CORE_IMPORTS):
                bad.append(f"{path}:{node.lineno}: {module}")
    assert not bad, "model files may import only the config types from engine_core:\n" + \
        "\n".join(bad)


def test_nothing_below_frontend_imports_it() -> None:
    bad = [f"{path}:{node.lineno}: {module}"
           for path, tree in SOURCES.items() if not path.startswith("frontend/")
           for node, module, _ in _imports(tree, _package(path))
           if _within(module, "tidal.frontend")]
    assert not bad, "engine_core and worker must not import frontend:\n" + "\n".join(bad)


def test_engine_core_imports_worker_only_where_listed() -> None:
    found: set[tuple[str, str]] = set()
    bad = []
    for path, tree in SOURCES.items():
        if not path.startswith("engine_core/"):
            continue
        for node, module, top in _imports(tree, _package(path)):
            if not _within(module, "tidal.worker"):
                continue
            if top:
                allowed = {key for key in ENGINE_CORE_WORKER_IMPORTS
                           if key[0] == path and _within(module, key[1])}
                found |= allowed
                if not allowed:
                    bad.append(f"{path}:{node.lineno}: {module} (module level)")
            elif path not in ENGINE_CORE_LAZY_WORKER_IMPORTERS:
                bad.append(f"{path}:{node.lineno}: {module} (in a function)")
    assert not bad, "engine_core must not import worker code:\n" + "\n".join(bad)
    stale = set(ENGINE_CORE_WORKER_IMPORTS) - found
    assert not stale, f"stale ENGINE_CORE_WORKER_IMPORTS entries: {stale}"


def test_registry_is_the_only_list_of_architectures() -> None:
    names = {arch for fam in FAMILIES for arch in fam.architectures}
    names |= {fam.gguf.hf_architecture for fam in FAMILIES if fam.gguf is not None}
    bad = []
    for path, tree in SOURCES.items():
        if path == "engine_core/model_registry.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names:
                bad.append(f"{path}:{node.lineno}: {node.value!r}")
    assert not bad, ("architecture names belong in engine_core/model_registry.py only:\n"
                     + "\n".join(bad))


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_registered_model_class_resolves(name: str) -> None:
    fam = family(name)
    module, _, cls_name = fam.model_class.partition(":")
    assert module.startswith("tidal.worker.models."), fam.model_class
    path = module.removeprefix("tidal.").replace(".", "/") + ".py"
    assert path in SOURCES, f"{name}: no file {path}"
    classes = {n.name for n in SOURCES[path].body if isinstance(n, ast.ClassDef)}
    assert cls_name in classes, f"{name}: {path} defines no class {cls_name}"
    cls = getattr(importlib.import_module(module), cls_name)
    assert isinstance(cls, type) and issubclass(cls, nn.Module)


# --- one kernel policy ------------------------------------------------------------------------

# Worker modules that read settings through envs, and why: none of them picks a kernel (those
# settings are the engine config's kernel section, read once by engine_core/kernel_config.py
# and handed to the workers resolved, as their KernelPolicy).
WORKER_ENV_READERS: dict[str, str] = {
    "worker/worker.py": "TIDAL_WARMUP: whether start-up runs the warm-up at all",
    "worker/worker_proc.py": "TIDAL_LOG_LEVEL: the log level of the spawned worker process",
    "worker/ops/kernel_cache.py": "where compiled kernels are cached (TIDAL_CACHE_DIR, Triton's "
                                  "and torch's own folder variables)",
    "worker/distributed/parallel_state.py": "GLOO_SOCKET_IFNAME: the network interface the "
                                            "user chose for gloo",
}
# Names a layer's or model's forward must not touch: the process-wide choosers of old and
# the policy's build-time entry points (a forward uses the kernels its constructor bound).
POLICY_GLOBALS = frozenset({"ops", "envs", "kernel_policy", "current_kernels",
                            "reference_kernels", "kernels_for", "triton_available", "DISPATCH"})


def _envs_users(tree: ast.Module, package: str) -> list[int]:
    return [node.lineno for node, module, _ in _imports(tree, package)
            if module == "tidal.engine_core.envs" or module.startswith("tidal.engine_core.envs.")]


def forward_policy_refs(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, name)`` for every policy global a ``forward`` method refers to."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "forward":
            for inner in ast.walk(node):
                if isinstance(inner, ast.Name) and inner.id in POLICY_GLOBALS:
                    found.append((inner.lineno, inner.id))
                elif isinstance(inner, (ast.Import, ast.ImportFrom)):
                    found.append((inner.lineno, "import"))
    return found


def test_policy_checker_finds_a_global_in_a_forward() -> None:
    code = """
class L:
    def __init__(self):
        self.k = current_kernels()
    def forward(self, x):
        if ops.gemv_applies(x):
            return x
        return self.k.linear(x)
class M:
    def forward(self, x):
        from tidal.worker import ops
        return x
"""
    assert forward_policy_refs(ast.parse(code)) == [(6, "ops"), (11, "import")]


def test_only_the_kernel_config_builder_reads_kernel_settings() -> None:
    bad = []
    for path, tree in SOURCES.items():
        users = _envs_users(tree, _package(path))
        if path.startswith("worker/") and users and path not in WORKER_ENV_READERS:
            bad.append(f"{path}:{users[0]}: reads envs (a kernel choice belongs in "
                       "KernelConfig; anything else: add the file to WORKER_ENV_READERS)")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr == "kernel_env"
                    and path != "engine_core/kernel_config.py"):
                bad.append(f"{path}:{node.lineno}: envs.kernel_env outside the builder")
    assert not bad, "\n".join(bad)
    stale = {p for p in WORKER_ENV_READERS if not _envs_users(SOURCES[p], _package(p))}
    assert not stale, f"stale WORKER_ENV_READERS entries: {stale}"


def test_forwards_use_the_kernels_bound_at_construction() -> None:
    bad = [f"{path}:{line}: {name}"
           for path, tree in SOURCES.items()
           if path.startswith(("worker/models/", "worker/layers/"))
           for line, name in forward_policy_refs(tree)]
    assert not bad, ("a forward must not consult a global kernel setting (take the kernels in "
                     "the constructor, kernel_policy.current_kernels):\n" + "\n".join(bad))
