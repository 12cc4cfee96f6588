"""Array-level operations: routing, packing and expert compute (pure-JAX references and Triton bindings)."""
