"""The one home of every Keras, JAX and PyTorch private the package uses.

`keras_private` (with `keras_variables`, `keras_globals` and
`keras_saving`), `jax_private` and `torch_private` wrap each private (a
`keras.src` or `jax._src` import, a private attribute, a global Keras
keeps, the locals of a Keras trainer frame) in a small named function that
says what it does, the versions it was checked on, and what breaks for the
user if it changes. Version differences are branched there and nowhere
else. Keras's are split by what they reach: `keras_private` the trainer,
distribution and backends, `keras_variables` a variable's slots,
`keras_globals` the globals Keras keeps, `keras_saving` the saving
internals. Each of `keras_private` (covering all four), `jax_private` and
`torch_private` has a `missing_privates()` listing what the installed
Keras, JAX or PyTorch no longer has (`tests/compat/test_compat.py` asserts the lists are
empty); the checks share `checks.failing` and `checks.attribute`.

Nothing here is imported by `import keras_autoshard`, and no module here
imports Keras, JAX or PyTorch until one of its functions is called.
"""
