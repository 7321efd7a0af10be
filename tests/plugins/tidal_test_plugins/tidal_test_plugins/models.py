"""A general plugin: registers a model family under a new architecture name (the Llama decoder,
subclassed), the way another package adds its own model to tidal. The class is named by an
import string, so only the worker imports it."""

from __future__ import annotations

import os

ARCHITECTURE = "TidalTestLlamaForCausalLM"


def register() -> None:
    if os.environ.get("TIDAL_TEST_PLUGIN_FAIL") == "general":
        raise RuntimeError("this plugin was told to fail")
    from tidal.engine_core.model_registry import register_model

    register_model(ARCHITECTURE, "tidal_test_plugins.llama_model:TidalTestLlamaForCausalLM")
