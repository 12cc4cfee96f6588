"""Device mesh, and the Head Parallel / Expert Parallel executors (shard_map over the mesh)."""
