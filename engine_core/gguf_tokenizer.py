"""The tokenizer stored in a GGUF file's metadata, as an HF tokenizer.

Rebuilding it takes seconds, so the result is saved under tidal's cache directory (keyed by the
file's path, size and mtime) and reloaded from there next time. The frontend loads it to
tokenize; the EngineCore loads it only for structured outputs' token masks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from typing import Any

from tidal.engine_core.envs import cache_dir

logger = logging.getLogger(__name__)


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
