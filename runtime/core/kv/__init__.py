"""The KV cache: a versioned block store, the block pool with prefix-cache hashes, the per-request
KV cache built on them, and its invariants."""
