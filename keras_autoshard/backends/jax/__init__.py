"""JAX backend: compiled-program reports, abstract tracing."""
