"""The API server's adapter table (``frontend/server/lora_models.py``) without an engine:
``--lora-modules`` parsing, the filesystem resolver's refusals, the runtime switch, start-up
errors named, and the CLI's one-API-server rule for runtime updates."""

from __future__ import annotations

import asyncio
import json

import pytest

from tidal.engine_core.lora_request import LoRARequest
from tidal.frontend.server.errors import APIError
from tidal.frontend.server.lora_models import (
    FilesystemResolver,
    LoRAModels,
    LoRAModule,
    dynamic_lora_id,
    parse_lora_modules,
)


class FakeEngine:
    def __init__(self, bad: set[str] = frozenset()) -> None:
        self.bad = bad
        self.added: list[LoRARequest] = []
        self.removed: list[int] = []

    async def add_lora(self, lora: LoRARequest) -> bool:
        if lora.lora_name in self.bad:
            raise ValueError(f"rank 32 exceeds --max-lora-rank 16 in {lora.lora_path}")
        self.added.append(lora)
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        self.removed.append(lora_int_id)
        return True


def test_parse_both_forms():
    mods = parse_lora_modules(["a=/x/a", json.dumps({"name": "b", "path": "/x/b",
                                                      "base_model_name": "m"})])
    assert mods == [LoRAModule("a", "/x/a"), LoRAModule("b", "/x/b", "m")]
    for bad, match in [("a", "name=path"), ("=/x", "name=path"), ('{"name": "a"}', "path"),
                       ('{"name": "a", "path": "/x", "rank": 8}', "unknown key")]:
        with pytest.raises(ValueError, match=match):
            parse_lora_modules([bad])
    with pytest.raises(ValueError, match="twice"):
        parse_lora_modules(["a=/x", "a=/y"])


def test_filesystem_resolver(tmp_path):
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "adapter_config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    r = FilesystemResolver(str(tmp_path))
    found = asyncio.run(r.resolve("base", "ok"))
    assert found is not None and found.lora_path == str(tmp_path / "ok")
    assert asyncio.run(r.resolve("base", "empty")) is None
    assert asyncio.run(r.resolve("base", "absent")) is None
    for name in ("../ok", "a/b", "..", ".hidden", "a\\b"):
        with pytest.raises(APIError) as exc:
            asyncio.run(r.resolve("base", name))
        assert exc.value.status == 400 and exc.value.param == "model"


def test_startup_modules_get_ids_in_order_and_a_bad_one_is_named():
    async def run(engine: FakeEngine) -> LoRAModels:
        table = LoRAModels(engine, "base", True)
        await table.register_startup([LoRAModule("a", "/x/a"), LoRAModule("b", "/x/b")])
        return table

    engine = FakeEngine()
    table = asyncio.run(run(engine))
    assert [(lr.lora_name, lr.lora_int_id, lr.base_model_name) for lr in engine.added] == [
        ("a", 1, "base"), ("b", 2, "base")]
    assert asyncio.run(table.lookup("base")) is None
    assert asyncio.run(table.lookup("b")).lora_int_id == 2
    with pytest.raises(ValueError, match="'b'.*rank 32"):
        asyncio.run(run(FakeEngine(bad={"b"})))


def test_runtime_updates_off_says_how_to_enable():
    table = LoRAModels(FakeEngine(), "base", True, runtime_updates=False)
    with pytest.raises(APIError) as exc:
        asyncio.run(table.load("x", "/tmp"))
    assert exc.value.status == 404 and "TIDAL_ALLOW_RUNTIME_LORA_UPDATING=1" in exc.value.message


def test_runtime_load_unload(tmp_path):
    engine = FakeEngine()
    table = LoRAModels(engine, "base", True, runtime_updates=True)

    async def run() -> None:
        lora = await table.load("x", str(tmp_path))
        assert lora.lora_int_id == dynamic_lora_id("x", str(tmp_path)) and lora.lora_int_id > 2
        for name, param in (("x", "lora_name"), ("base", "lora_name")):
            with pytest.raises(APIError) as exc:
                await table.load(name, str(tmp_path))
            assert exc.value.status == 400 and exc.value.param == param
        await table.unload("x")
        assert engine.removed == [lora.lora_int_id]
        with pytest.raises(APIError) as exc:
            await table.lookup("x")
        assert exc.value.status == 404

    asyncio.run(run())


def test_runtime_updates_need_one_api_server(monkeypatch):
    import argparse

    from tidal.engine_core.config import EngineArgs
    from tidal.frontend.cli import _api_server_count

    monkeypatch.setenv("TIDAL_ALLOW_RUNTIME_LORA_UPDATING", "1")
    ns = argparse.Namespace(api_server_count=2, engine_address=None)
    with pytest.raises(SystemExit, match="one API server"):
        _api_server_count(ns, EngineArgs())
    ns.api_server_count = None
    assert _api_server_count(ns, EngineArgs()) == 1


def test_lora_flags_need_enable_lora():
    from tidal.frontend.cli import _server_settings, build_parser

    ns = build_parser().parse_args(["serve", "--lora-modules", "a=/x"])
    with pytest.raises(SystemExit, match="need --enable-lora"):
        _server_settings(ns)
