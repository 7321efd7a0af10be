"""Load the tokenizer of a model: from an HF folder, or rebuilt from a GGUF file's metadata.

Rebuilding a tokenizer from GGUF metadata takes seconds, so the result is saved under tidal's
cache directory (keyed by the file's path, size and mtime) and reloaded from there next time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from typing import Any

from tidal.engine_core.config import ModelConfig
from tidal.engine_core.envs import cache_dir

logger = logging.getLogger(__name__)


def load_tokenizer(model: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    start = time.perf_counter()
    path = model.tokenizer
    if path.endswith(".gguf"):
        tok = load_gguf_tokenizer(path)
    else:
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot load the tokenizer: {exc}") from exc
    if getattr(tok, "chat_template", None) is None and model.chat_template:
        tok.chat_template = model.chat_template
    logger.info("tokenizer %s loaded in %.2f s (%d tokens)", type(tok).__name__,
                time.perf_counter() - start, len(tok))
    return tok


def load_gguf_tokenizer(path: str) -> Any:
    """The tokenizer stored in a GGUF file's metadata (cached as HF files after the first load)."""
    from transformers import AutoTokenizer

    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode())
    cached = cache_dir() / "tokenizers" / key.hexdigest()[:24]
    if (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError) as exc:
            logger.warning("ignoring a broken cached tokenizer in %s: %s", cached, exc)
    folder, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    try:
        tok.save_pretrained(str(tmp))
        if cached.exists():  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, cached)
    except OSError as exc:
        logger.debug("could not cache the tokenizer in %s: %s", cached, exc)
    return tok


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a text prompt, with the special tokens the tokenizer adds by default."""
    return list(tokenizer.encode(prompt))


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True,
                        chat_template: str | None = None, **kwargs: Any) -> list[int]:
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; pass chat_template=... "
                         "or use a completion prompt")
    ids = tokenizer.apply_chat_template(messages, tokenize=True,
                                        add_generation_prompt=add_generation_prompt,
                                        chat_template=chat_template, **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
