"""The installed package layout matches the source tree."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_source_package_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    on_disk = set()
    for top_name, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            on_disk.add(".".join([top_name, *rel.parts]))
    assert on_disk == listed, f"missing: {on_disk - listed}, stale: {listed - on_disk}"


def test_public_api():
    from tidal.frontend import LLM, SamplingParams

    assert callable(LLM) and SamplingParams(n=2).n == 2
