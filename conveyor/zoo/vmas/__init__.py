"""Zoo entries for VMAS: vectorized multi-agent scenarios; navigation by default."""
