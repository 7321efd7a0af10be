"""The name a model folder is served under by default: its folder's name, or the model's own
name where the folder's says nothing (``model``, an HF cache commit); ``served_model_name``
overrides both."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import reference

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.model_source import resolve_model

CARD = "---\nlicense: apache-2.0\ntags:\n- x\n---\n\n{title}\n\nSome text.\n\n# Usage\n"


def _folder(path: Path, *, card: str | None = None, name_or_path: str | None = None) -> Path:
    path.mkdir(parents=True)
    config = reference.tiny_hf_config("llama").to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    if name_or_path is not None:
        config["_name_or_path"] = name_or_path
    (path / "config.json").write_text(json.dumps(config))
    if card is not None:
        (path / "README.md").write_text(CARD.format(title=card))
    return path


def _name(path: Path) -> str:
    return resolve_model(str(path)).name


def test_a_generic_folder_is_named_by_its_model_card(tmp_path):
    assert _name(_folder(tmp_path / "a" / "model", card="# all-MiniLM-L6-v2",
                         name_or_path="nreimers/MiniLM-L6-H384-uncased")) == "all-MiniLM-L6-v2"
    assert _name(_folder(tmp_path / "b" / "model", card="# org/Some-Model.v2")) == "Some-Model.v2"


def test_then_by_its_config_then_the_folder(tmp_path):
    # A title that is a sentence is no name; the YAML front matter is no title.
    assert _name(_folder(tmp_path / "a" / "weights", card="# Model card for X",
                         name_or_path="org/base-model")) == "base-model"
    # A local path in _name_or_path (where the model was saved from) names nothing.
    assert _name(_folder(tmp_path / "b" / "model", name_or_path="/home/me/ckpt")) == "model"
    assert _name(_folder(tmp_path / "c" / "model", name_or_path="")) == "model"


def test_an_hf_cache_snapshot_is_named_by_its_repository(tmp_path):
    snapshot = tmp_path / "models--Qwen--Qwen3-0.6B" / "snapshots" / ("0123abcd" * 5)
    assert _name(_folder(snapshot, card="# Something-Else")) == "Qwen3-0.6B"


def test_an_informative_folder_name_wins(tmp_path, monkeypatch):
    folder = _folder(tmp_path / "my-finetune", card="# base-model", name_or_path="org/base")
    assert _name(folder) == "my-finetune"
    monkeypatch.chdir(folder)
    assert _name(Path(".")) == "my-finetune"
    monkeypatch.chdir(folder / "..")
    assert _name(Path(os.curdir) / "my-finetune" / "") == "my-finetune"


def test_served_model_name_overrides(tmp_path):
    folder = _folder(tmp_path / "model", card="# tiny-llama")
    assert EngineArgs(model=str(folder)).create_config().model.served_model_name == "tiny-llama"
    config = EngineArgs(model=str(folder), served_model_name="alias").create_config()
    assert config.model.served_model_name == "alias"


@pytest.mark.parametrize("card", ["", "# \n", "no heading at all\n", "---\nunterminated: yes\n"])
def test_odd_model_cards_fall_back(tmp_path, card):
    folder = _folder(tmp_path / "model")
    (folder / "README.md").write_text(card)
    assert _name(folder) == "model"
