"""The model runner's calls into the KV connector's worker side, at fixed points of a step.

``before_forward`` decodes the step's ``KVConnectorMetadata`` and starts its loads (and the host
tier's stores), then waits for every layer's loads: CUDA graphs replay whole forwards, so the
per-layer waits are not placed inside attention. ``after_forward`` offers each layer's cache to
``save_kv_layer``, waits for the saves and collects the finished transfers for the step's
``ModelRunnerOutput``. A step without metadata (warm-up, profiling, steps of an engine whose
scheduler sent none) skips both.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec

from tidal.engine_core.kv_transfer.connector_base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from tidal.engine_core.kv_transfer.connector_registry import create_connector

if TYPE_CHECKING:
    import torch

    from tidal.engine_core.config import EngineConfig
    from tidal.engine_core.protocol import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class ConnectorHooks:
    __slots__ = ("connector", "_decoder", "_kv_caches")

    def __init__(self, connector: KVConnectorBase) -> None:
        self.connector = connector
        self._decoder = msgspec.msgpack.Decoder(connector.metadata_type)
        self._kv_caches: list[torch.Tensor] = []

    @classmethod
    def create(cls, config: EngineConfig, rank: int) -> ConnectorHooks | None:
        """Hooks for the configured connector's worker side; None when KV transfer is off."""
        connector = create_connector(config, KVConnectorRole.WORKER, rank)
        return None if connector is None else cls(connector)

    def register(self, kv_caches: list[torch.Tensor]) -> None:
        self._kv_caches = kv_caches
        self.connector.register_kv_caches(kv_caches)

    def before_forward(self, so: SchedulerOutput) -> KVConnectorMetadata | None:
        if not so.kv_connector_metadata:
            return None
        meta = self._decoder.decode(so.kv_connector_metadata)
        connector = self.connector
        connector.start_load_kv(meta)
        for i in range(len(self._kv_caches)):
            connector.wait_for_layer_load(i)
        return meta

    def after_forward(self, so: SchedulerOutput, meta: KVConnectorMetadata | None
                      ) -> tuple[list[str], list[str], list[int]]:
        """Saves of this step; returns the (sending, receiving) transfers finished since the
        last step and the blocks its loads failed to fill, for ``report``."""
        if meta is None:
            return [], [], []
        connector = self.connector
        for i, cache in enumerate(self._kv_caches):
            connector.save_kv_layer(i, cache, meta)
        connector.wait_for_save()
        sending, recving = connector.get_finished(so.finished_req_ids)
        invalid = connector.get_block_ids_with_load_errors()
        return sorted(sending), sorted(recving), sorted(invalid)

    @staticmethod
    def report(result: ModelRunnerOutput,
               finished: tuple[list[str], list[str], list[int]]) -> None:
        (result.kv_finished_sending, result.kv_finished_recving,
         result.kv_invalid_block_ids) = finished

    def shutdown(self) -> None:
        self.connector.shutdown()
