"""Collectives for hand-written parallel code, on JAX arrays and PyTorch
tensors alike: `all_reduce`, `all_gather`, `reduce_scatter`, `broadcast`,
`scatter`, and Megatron's `copy_to_parallel` / `reduce_from_parallel`.

This is the public name; the implementation lives in
`keras_autoshard/runtime/collectives/` (one module per backend).
"""

from keras_autoshard.runtime.collectives import (
    CollectiveError,
    all_gather,
    all_reduce,
    broadcast,
    copy_to_parallel,
    reduce_from_parallel,
    reduce_scatter,
    scatter,
)

__all__ = [
    "CollectiveError",
    "all_gather",
    "all_reduce",
    "broadcast",
    "copy_to_parallel",
    "reduce_from_parallel",
    "reduce_scatter",
    "scatter",
]
