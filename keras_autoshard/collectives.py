"""Deprecated: the collectives are `keras_autoshard.distributed`'s now
(`keras_autoshard.distributed.all_reduce`, ...), their error
`keras_autoshard.errors.CollectiveError`. Each name here keeps working for one
release, with a `DeprecationWarning` naming its new spelling."""

import importlib
import warnings

_COLLECTIVES = "keras_autoshard.runtime.collectives"

# Old name -> its spelling now.
_MOVED = {
    **{
        name: f"keras_autoshard.distributed.{name}"
        for name in (
            "all_gather",
            "all_reduce",
            "broadcast",
            "copy_to_parallel",
            "reduce_from_parallel",
            "reduce_scatter",
            "scatter",
        )
    },
    "CollectiveError": "keras_autoshard.errors.CollectiveError",
}


def __getattr__(name):
    now = _MOVED.get(name)
    if now is None:
        raise AttributeError(
            f"module 'keras_autoshard.collectives' has no attribute {name!r}"
        )
    warnings.warn(
        f"keras_autoshard.collectives.{name} is deprecated and leaves in the "
        f"next release: use {now}.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(_COLLECTIVES), name)


def __dir__():
    return sorted(set(globals()) | set(_MOVED))
