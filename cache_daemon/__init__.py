"""The cache daemon: owns expert memory (device arena, pinned host pool, NVMe store) and serves it."""
