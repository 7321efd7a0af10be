"""The KV-transfer section of the engine config (``--kv-transfer-config`` / ``--kv-offload-gb``).

Field names are vLLM's ``KVTransferConfig``'s, so a JSON written for vLLM reads the same here:
``kv_connector`` names a registered connector (``engine_core/kv_transfer/connector_registry``),
``kv_role`` says which side of a transfer this engine is, and the rest are the connector's
buffers, address and extra options. Validated once, at ``EngineArgs.create_config``; the
connector itself checks its ``kv_connector_extra_config`` when it is built.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any

import msgspec

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# The in-tree connectors; plugins add theirs through the ``tidal.kv_connectors`` entry points.
OFFLOADING_CONNECTOR = "OffloadingConnector"
# A KV buffer, host tier or send buffer larger than this is a typo, not a plan (1 TiB).
MAX_BUFFER_BYTES = float(2**40)
_FIELDS = ("kv_connector", "kv_role", "kv_buffer_size", "kv_ip", "kv_port",
           "kv_connector_extra_config", "kv_buffer_device", "engine_id")


class KVTransferConfigError(ValueError):
    """The KV-transfer section is impossible; the message names the field."""


class KVTransferConfig(msgspec.Struct, frozen=True, kw_only=True):
    kv_connector: str
    kv_role: str = "kv_both"
    # Bytes of the connector's buffer: the host tier's size for the OffloadingConnector, the
    # bounded send buffer for a P2P producer.
    kv_buffer_size: float = 1e9
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    # Where the connector stages KV: "cpu" (host memory) or the engine's device ("cuda").
    kv_buffer_device: str = "cpu"
    # Names this engine to its peers (disaggregated serving); "" lets the connector pick.
    engine_id: str = ""
    kv_connector_extra_config: dict[str, Any] = {}

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str, default: Any = None) -> Any:
        """One of ``kv_connector_extra_config``'s options."""
        return self.kv_connector_extra_config.get(key, default)


def build_kv_transfer_config(raw: str | dict[str, Any] | None,
                             offload_gb: float | None) -> KVTransferConfig | None:
    """The validated section, or None when neither flag is given.

    ``raw``: ``--kv-transfer-config`` (a JSON object, as text or parsed); ``offload_gb``:
    ``--kv-offload-gb``, shorthand for the OffloadingConnector with a host tier of that many GB
    (10**9 bytes, as vLLM counts). Raises ``KVTransferConfigError`` naming the bad field.
    """
    if offload_gb is not None:
        if isinstance(offload_gb, bool) or not isinstance(offload_gb, (int, float)) \
                or not offload_gb > 0 or offload_gb * 1e9 > MAX_BUFFER_BYTES:
            raise KVTransferConfigError(
                f"--kv-offload-gb must be a number of GB in (0, {MAX_BUFFER_BYTES / 1e9:.0f}], "
                f"got {offload_gb!r}")
        if raw is not None:
            raise KVTransferConfigError(
                "give either --kv-offload-gb or --kv-transfer-config, not both (--kv-offload-gb "
                "is shorthand for an OffloadingConnector kv-transfer config)")
        return KVTransferConfig(kv_connector=OFFLOADING_CONNECTOR, kv_role="kv_both",
                                kv_buffer_size=float(offload_gb) * 1e9)
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise KVTransferConfigError(f"--kv-transfer-config is not valid JSON: {exc}") \
                from None
    if not isinstance(raw, dict):
        raise KVTransferConfigError(
            f"--kv-transfer-config must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise KVTransferConfigError(
            f"--kv-transfer-config: unknown field(s) {', '.join(unknown)} (known: "
            f"{', '.join(_FIELDS)})")
    if "kv_connector" not in raw:
        raise KVTransferConfigError("--kv-transfer-config: kv_connector is required (e.g. "
                                    f"{OFFLOADING_CONNECTOR!r})")
    try:
        config = msgspec.convert(raw, KVTransferConfig)
    except msgspec.ValidationError as exc:
        raise KVTransferConfigError(f"--kv-transfer-config: {exc}") from None
    _check(config)
    return config


def _check(c: KVTransferConfig) -> None:
    if not c.kv_connector.strip():
        raise KVTransferConfigError("--kv-transfer-config: kv_connector must name a connector")
    if c.kv_role not in KV_ROLES:
        raise KVTransferConfigError(
            f"--kv-transfer-config: kv_role must be one of {', '.join(KV_ROLES)}, got "
            f"{c.kv_role!r}")
    if not 0 < c.kv_buffer_size <= MAX_BUFFER_BYTES:
        raise KVTransferConfigError(
            f"--kv-transfer-config: kv_buffer_size must be a byte count in (0, 2**40], got "
            f"{c.kv_buffer_size!r}")
    if not 0 < c.kv_port < 65536:
        raise KVTransferConfigError(
            f"--kv-transfer-config: kv_port must be in 1..65535, got {c.kv_port}")
    try:
        ipaddress.ip_address(c.kv_ip)
    except ValueError:
        if c.kv_ip != "localhost":
            raise KVTransferConfigError(
                f"--kv-transfer-config: kv_ip must be an IP address, got {c.kv_ip!r}") from None
    if c.kv_buffer_device not in ("cpu", "cuda"):
        raise KVTransferConfigError(
            f"--kv-transfer-config: kv_buffer_device must be 'cpu' or 'cuda', got "
            f"{c.kv_buffer_device!r}")
