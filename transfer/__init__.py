"""KV transfer between prefill and decode workers (see docs/kv_transfer.md).

Prefill worker::

    from pdserve.transfer.server import KVServer
    server = KVServer(pool, CompatRecord.for_pool(pool, model_id), transport="nixl",
                      host=host, port=side_channel_port, on_release=lease_manager.release)
    handle = server.make_handle(request_id, block_ids, num_tokens, block_hashes, lease_seconds)
    ...
    server.close()

Decode worker (the engine's ``KVConnector``)::

    from pdserve.transfer.connector import RemoteKVConnector
    connector = RemoteKVConnector(pool, CompatRecord.for_pool(pool, model_id), transport="nixl",
                                  transfer_timeout=10.0)

Nothing is imported here, so ``pdserve.transfer.messages`` stays cheap for the router.
"""
