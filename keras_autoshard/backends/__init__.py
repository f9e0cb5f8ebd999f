"""Backend-specific code; nothing outside `backends.jax` imports JAX."""
