"""KV connector name -> class.

In-tree connectors are listed by import string, so naming one imports only its own module (the
scheduler side never pulls in another connector's transport). Plugins add connectors through the
``tidal.kv_connectors`` entry-point group (``engine_core/plugins``): the entry point's name is the
``kv_connector`` value and it loads a ``KVConnectorBase`` subclass. An in-tree name wins over a
plugin of the same name.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tidal.engine_core import plugins
from tidal.engine_core.kv_transfer.connector_base import KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from tidal.engine_core.config import EngineConfig

logger = logging.getLogger(__name__)

KV_CONNECTORS_GROUP = "tidal.kv_connectors"

# name -> "module:Class" of the in-tree connectors.
_BUILTIN: dict[str, str] = {
    "OffloadingConnector": "tidal.engine_core.kv_transfer.offloading_connector:OffloadingConnector",
    "P2pConnector": "tidal.engine_core.kv_transfer.p2p_connector:P2pConnector",
}


class KVConnectorError(ValueError):
    """An unknown or broken connector; the message names it."""


def builtin_names() -> list[str]:
    return sorted(_BUILTIN)


def connector_names() -> list[str]:
    """Every name ``kv_connector`` may take here: the in-tree ones and allowed plugins."""
    return sorted(set(_BUILTIN) | set(plugins.plugin_names(KV_CONNECTORS_GROUP)))


def connector_class(name: str) -> type[KVConnectorBase]:
    """The class registered as ``name``; ``KVConnectorError`` when none is, or it is no
    ``KVConnectorBase``."""
    target = _BUILTIN.get(name)
    try:
        if target is not None:
            cls = plugins.import_string(target)
        elif name in plugins.plugin_names(KV_CONNECTORS_GROUP):
            cls = plugins.load_plugin(KV_CONNECTORS_GROUP, name)
        else:
            raise KVConnectorError(
                f"kv_connector {name!r} is not a known KV connector (known: "
                f"{', '.join(connector_names())})")
    except plugins.PluginError as exc:
        raise KVConnectorError(f"kv_connector {name!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise KVConnectorError(f"kv_connector {name!r} loads {cls!r}, which is not a "
                               "KVConnectorBase subclass")
    return cls


def create_connector(config: EngineConfig, role: KVConnectorRole,
                     rank: int = 0) -> KVConnectorBase | None:
    """The configured connector's ``role`` half, or None when KV transfer is off."""
    if config.kv_transfer is None:
        return None
    cls = connector_class(config.kv_transfer.kv_connector)
    logger.info("KV connector %s (%s side, role %s)", config.kv_transfer.kv_connector,
                role.name.lower(), config.kv_transfer.kv_role)
    return cls(config, role, rank)


def check_connector(config: EngineConfig) -> None:
    """At config time: the configured name resolves and its class accepts this engine
    (``KVConnectorBase.check_config``); raises ``ValueError`` (``KVConnectorError``) naming
    what it refuses."""
    assert config.kv_transfer is not None
    connector_class(config.kv_transfer.kv_connector).check_config(config)
