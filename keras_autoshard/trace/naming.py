"""Keep Keras's auto-generated names stable across repeated model builds.

Keras numbers unnamed layers and variables from a global counter (`dense`,
`dense_1`, ...), so building the same model twice gives different variable
paths. A plan is keyed by path, so a model built for planning must leave the
counters as it found them.
"""

from __future__ import annotations

import contextlib

from keras_autoshard.compat import keras_globals


@contextlib.contextmanager
def names_replayed_after():
    """Run a build whose auto-generated names the next build will reuse.

    On exit, Keras's name counters are restored to their state on entry, so
    the next model built the same way gets the same layer and variable paths.

    Example:

    ```python
    with names_replayed_after():
        reference = build_model()
    model = build_model()   # same variable paths as `reference`
    ```
    """
    with keras_globals.name_counters_kept():
        yield
