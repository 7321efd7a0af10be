"""The model names one API server answers to: the base model and its LoRA adapters.

A request's ``model`` picks the base model (its served name) or an adapter by name. Adapters
come from ``--lora-modules`` (registered at start-up: ids 1..N in flag order, so every API
server process builds the same table), from ``POST /v1/load_lora_adapter`` (with
``$TIDAL_ALLOW_RUNTIME_LORA_UPDATING=1``), or from the LoRA resolvers an unknown name is
offered to, in order (``--lora-resolver-dir`` first, then ``tidal.lora_resolvers`` plugins).

Every adapter is registered in the engine (``AddLora``: its files are checked against the base
model) before its name is served, so a bad one is a 400 with the engine's reason. An adapter
added after start-up gets an id derived from its name and path: API server processes that
resolve the same name agree on it, and a clash is refused by the engine, never mixed up.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidal.engine_core.lora_request import LoRARequest
from tidal.frontend.server.errors import APIError, bad_request

if TYPE_CHECKING:
    from tidal.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

MAX_LORA_NAME_CHARS = 256
# Ids from --lora-modules are 1..N; later ones are hashed into [_DYNAMIC_BASE, 2^31).
_DYNAMIC_BASE = 1 << 20


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One ``--lora-modules`` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str]) -> list[LoRAModule]:
    """``--lora-modules`` values: ``name=path`` or vLLM's JSON form ``{"name": ..., "path": ...,
    "base_model_name": ...}``. Raises ValueError naming the bad entry."""
    out: list[LoRAModule] = []
    for raw in values:
        raw = raw.strip()
        if raw.startswith("{"):
            try:
                obj = json.loads(raw)
            except ValueError as exc:
                raise ValueError(f"--lora-modules {raw[:80]!r} is not valid JSON: {exc}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
                    or not isinstance(obj.get("path"), str):
                raise ValueError(f"--lora-modules {raw[:80]!r}: the JSON form needs string "
                                 "\"name\" and \"path\" (and optionally \"base_model_name\")")
            extra = sorted(set(obj) - {"name", "path", "base_model_name"})
            if extra:
                raise ValueError(f"--lora-modules {raw[:80]!r}: unknown key(s) {extra}")
            module = LoRAModule(obj["name"], obj["path"], obj.get("base_model_name"))
        else:
            name, sep, path = raw.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {raw[:80]!r}: give name=path or the JSON form")
            module = LoRAModule(name, path)
        check_lora_name(module.name)
        if any(m.name == module.name for m in out):
            raise ValueError(f"--lora-modules names {module.name!r} twice")
        out.append(module)
    return out


def check_lora_name(name: str) -> None:
    if not name or len(name) > MAX_LORA_NAME_CHARS or any(c in name for c in "\x00\n\r"):
        raise ValueError(f"a LoRA adapter name must be 1 to {MAX_LORA_NAME_CHARS} printable "
                         f"characters, got {name[:80]!r}")


def dynamic_lora_id(name: str, path: str) -> int:
    digest = hashlib.sha256(f"{name}\x00{path}".encode()).digest()
    return _DYNAMIC_BASE + int.from_bytes(digest[:4], "little") % ((1 << 31) - _DYNAMIC_BASE)


class FilesystemResolver:
    """``--lora-resolver-dir DIR``: an unknown model name ``x`` is the adapter in ``DIR/x``
    (a folder holding ``adapter_config.json``). Names that could leave ``DIR`` are refused."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)

    async def resolve(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        if "/" in lora_name or "\\" in lora_name or lora_name in (".", "..") \
                or lora_name.startswith("."):
            raise bad_request(f"the model name {lora_name[:100]!r} cannot name an adapter "
                              "folder (no '/', '\\' or leading '.')", "model",
                              code="invalid_model_name")
        path = os.path.join(self.root, lora_name)
        # (A symlink inside DIR pointing elsewhere is the operator's choice; a name is not.)
        if os.path.dirname(os.path.abspath(path)) != self.root:
            raise bad_request("the model name leaves the resolver directory", "model",
                              code="invalid_model_name")
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            return None
        return LoRARequest(lora_name, 1, path, base_model_name)


@dataclass(slots=True)
class LoRAModels:
    """The adapter table of one API server process."""

    engine: AsyncLLM
    base_model_name: str
    enabled: bool  # the engine runs LoRA (--enable-lora)
    runtime_updates: bool = False  # load / unload endpoints (the env var, one API server)
    resolvers: dict[str, Any] = field(default_factory=dict)
    by_name: dict[str, LoRARequest] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def register_startup(self, modules: list[LoRAModule]) -> None:
        """Register ``--lora-modules`` (ids 1..N); the first bad one raises ValueError naming
        it."""
        for i, m in enumerate(modules, 1):
            if m.name == self.base_model_name:
                raise ValueError(f"--lora-modules: {m.name!r} is the base model's name")
            lora = LoRARequest(m.name, i, os.path.abspath(m.path),
                               m.base_model_name or self.base_model_name)
            try:
                await self.engine.add_lora(lora)
            except Exception as exc:  # noqa: BLE001 - named and stops start-up
                raise ValueError(f"--lora-modules: adapter {m.name!r} ({m.path}): "
                                 f"{exc}") from None
            self.by_name[m.name] = lora
            logger.info("LoRA adapter %s (id %d) from %s", m.name, i, lora.lora_path)

    async def lookup(self, name: str) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model. Unknown names
        go to the resolvers; a name none of them knows is a 404."""
        if name == self.base_model_name:
            return None
        lora = self.by_name.get(name)
        if lora is not None:
            return lora
        if self.enabled and self.resolvers:
            async with self._lock:
                lora = self.by_name.get(name) or await self._resolve(name)
            if lora is not None:
                return lora
        shown = name if len(name) <= 100 else name[:100] + "..."
        served = [self.base_model_name, *self.by_name][:20]
        raise APIError(404, f"the model {shown!r} does not exist on this server; it serves "
                       f"{', '.join(repr(s) for s in served)} (GET /v1/models lists them)",
                       param="model", code="model_not_found")

    async def _resolve(self, name: str) -> LoRARequest | None:
        try:
            check_lora_name(name)
        except ValueError:
            return None
        for rname, resolver in self.resolvers.items():
            try:
                found = await resolver.resolve(self.base_model_name, name)
            except APIError:
                raise
            except Exception as exc:  # noqa: BLE001 - a broken resolver is not the client's
                logger.warning("LoRA resolver %s failed for %r: %s", rname, name[:100], exc)
                continue
            if found is None:
                continue
            if not isinstance(found, LoRARequest):
                logger.warning("LoRA resolver %s returned %s, not a LoRARequest", rname,
                               type(found).__name__)
                continue
            lora = LoRARequest(name, dynamic_lora_id(name, found.lora_path), found.lora_path,
                               found.base_model_name or self.base_model_name)
            await self._add(lora)
            logger.info("LoRA adapter %s (id %d) resolved by %s from %s", name,
                        lora.lora_int_id, rname, lora.lora_path)
            return lora
        return None

    async def _add(self, lora: LoRARequest) -> None:
        from tidal.frontend.async_llm import EngineDeadError

        try:
            await self.engine.add_lora(lora)
        except EngineDeadError:
            raise
        except Exception as exc:  # noqa: BLE001 - the engine's reason, to the client
            raise bad_request(f"LoRA adapter {lora.lora_name!r} cannot be loaded: "
                              f"{str(exc)[:1000]}", "lora_path", code="invalid_lora_adapter"
                              ) from None
        self.by_name[lora.lora_name] = lora

    def _check_runtime(self) -> None:
        if not self.runtime_updates:
            raise APIError(404, "loading and unloading LoRA adapters at run time is off; start "
                           "the server with TIDAL_ALLOW_RUNTIME_LORA_UPDATING=1 (and "
                           "--enable-lora, one API server process) to allow it",
                           code="not_found")

    async def load(self, name: Any, path: Any) -> LoRARequest:
        self._check_runtime()
        if not isinstance(name, str) or not name:
            raise bad_request("lora_name is required (a string)", "lora_name")
        if not isinstance(path, str) or not path:
            raise bad_request("lora_path is required (a string)", "lora_path")
        try:
            check_lora_name(name)
        except ValueError as exc:
            raise bad_request(str(exc), "lora_name") from None
        async with self._lock:
            if name == self.base_model_name or name in self.by_name:
                raise bad_request(f"the model name {name[:100]!r} is already served; unload "
                                  "it first or pick another name", "lora_name",
                                  code="duplicate_lora_name")
            if not os.path.isdir(path):
                raise bad_request(f"lora_path {path[:200]!r} is not a folder on the server",
                                  "lora_path", code="invalid_lora_adapter")
            path = os.path.abspath(path)
            lora = LoRARequest(name, dynamic_lora_id(name, path), path, self.base_model_name)
            await self._add(lora)
        logger.info("LoRA adapter %s (id %d) loaded from %s", name, lora.lora_int_id, path)
        return lora

    async def unload(self, name: Any) -> None:
        self._check_runtime()
        if not isinstance(name, str) or not name:
            raise bad_request("lora_name is required (a string)", "lora_name")
        async with self._lock:
            lora = self.by_name.get(name)
            if lora is None:
                raise APIError(404, f"no LoRA adapter {name[:100]!r} is loaded",
                               param="lora_name", code="lora_not_found")
            del self.by_name[name]
            await self.engine.remove_lora(lora.lora_int_id)
        logger.info("LoRA adapter %s (id %d) unloaded", name, lora.lora_int_id)
