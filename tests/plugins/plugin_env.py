"""Makes the test plugin package (``tests/plugins/tidal_test_plugins``) installed for a process:
its ``.dist-info`` (entry points read from its pyproject.toml) in a temporary folder, which with
the package's source folder goes on ``sys.path`` / ``PYTHONPATH``. The plugins are then found as
any installed package's are, through ``importlib.metadata``, and nothing is installed into the
test environment (other servers of the suite load no test plugins)."""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent / "tidal_test_plugins"


def write_dist_info(folder: Path) -> Path:
    """``tidal_test_plugins-<version>.dist-info`` in ``folder``; returns ``folder``."""
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, eps in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{ep} = {target}" for ep, target in eps.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    return folder


def plugin_paths(folder: Path) -> list[str]:
    return [str(write_dist_info(folder)), str(PACKAGE)]


def plugin_env(folder: Path, **extra: str) -> dict[str, str]:
    """An environment for a process that has the test plugins installed."""
    paths = plugin_paths(folder)
    old = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths + ([old] if old else [])),
                **extra)


def install_here(folder: Path) -> list[str]:
    """Put the plugins on this process's path; returns the entries to remove afterwards."""
    paths = plugin_paths(folder)
    sys.path[:0] = paths
    return paths
