"""mhl-jax: Multi-Head LatentMoE and Head Parallel in JAX."""
