"""Load the tokenizer of a model: from an HF folder, or rebuilt from a GGUF file's metadata.

Rebuilding a tokenizer from GGUF metadata takes seconds, so the result is saved under tidal's
cache directory (keyed by the file's path, size and mtime) and reloaded from there next time
(``engine_core/gguf_tokenizer.py``: the EngineCore reads the same cache for its token masks).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tidal.engine_core.config import ModelConfig
from tidal.engine_core.gguf_tokenizer import load_gguf_tokenizer  # noqa: F401 - re-exported

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
