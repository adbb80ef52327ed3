"""The paged KV cache: block pool, allocator, prefix cache (RAM and disk), KV sources, paged attention."""
