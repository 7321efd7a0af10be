"""KV transfer: moving a request's KV cache blocks into or out of this engine's KV pool.

Layout (the arrows run engine_core -> worker):

- ``engine_core/kv_transfer_config.py``: the ``--kv-transfer-config`` / ``--kv-offload-gb``
  section of the engine config;
- ``engine_core/kv_transfer/connector_base.py``: the connector API, ``KVConnectorBase``, one class
  per connector with a scheduler side (in the EngineCore process) and a worker side (in each
  worker process), built once per side with its ``KVConnectorRole``;
- ``engine_core/kv_transfer/connector_registry.py``: connector name -> class, in-tree ones by
  import string and plugins through the ``tidal.kv_connectors`` entry points;
- ``engine_core/kv_transfer/offloading_connector.py``: the host-memory KV tier's scheduler side
  (which block hash lives in which host slot); its worker side copies through
  ``worker/kv_transfer/host_kv_store.py`` (torch tensors, pinned host memory);
- ``engine_core/kv_transfer/p2p_connector.py``: disaggregated prefill/decode between two engines
  of one host (``P2pConnector``); its tensors move over ``p2p_transport.py`` (ZeroMQ frames, or
  a two-rank gloo / NCCL group per producer-consumer pair from ``p2p_pair_group.py``), pulled in
  the background by ``p2p_async_pull.py`` (the request waits, others decode); a synchronous load
  that fails is recomputed through ``load_recovery.py`` (the scheduler drops that step's
  outputs of the requests on the unfilled blocks).
"""
