"""A platform plugin: with ``$TIDAL_TEST_PLATFORM=1``, a CPU platform whose default attention
backend is the torch one (else no platform: the built-ins decide)."""

from __future__ import annotations

import os


class TestCpuPlatform:
    name = "test-cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    default_attention_backend: str | None = "torch"

    def is_available(self) -> bool:
        return True


def make_platform() -> TestCpuPlatform | None:
    return TestCpuPlatform() if os.environ.get("TIDAL_TEST_PLATFORM") == "1" else None
