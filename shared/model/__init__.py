"""The model core: checkpoint loading, the U-shaped split, KV caches, the draft adapter."""
