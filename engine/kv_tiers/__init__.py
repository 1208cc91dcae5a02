"""KV tiers below the pool: host memory, local disk, a shared Redis/Valkey store
(docs/kv_tiers.md)."""
