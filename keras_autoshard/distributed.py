"""The processes of a multi-process job and the collectives between them, as
`torch.distributed` holds both.

- `initialize`: join the job (JAX processes or a torch process group);
  `resolve_cluster`: which cluster this process would join, without joining;
  `process_batch_rows`: the rows of each global batch this process loads.
- Collectives for hand-written parallel code, on JAX arrays and PyTorch
  tensors alike: `all_reduce`, `all_gather`, `reduce_scatter`, `broadcast`,
  `scatter`, and Megatron's `copy_to_parallel` / `reduce_from_parallel`
  (their errors: `keras_autoshard.errors.CollectiveError`).

Imported lazily, like the package, so that `import keras_autoshard.distributed`
imports neither Keras nor JAX nor torch.

Example:

```python
import keras_autoshard as ka

spec = ka.distributed.initialize()  # first thing, on every process
rows = ka.distributed.process_batch_rows(64, dist)  # this process's rows
total = ka.distributed.all_reduce(partial, axis_name="model")  # in shard_map
```
"""

from keras_autoshard.lazy_names import lazy_attributes

_COLLECTIVES = "keras_autoshard.runtime.collectives"
_NAMES = {
    "initialize": "keras_autoshard.runtime.cluster",
    "resolve_cluster": "keras_autoshard.runtime.cluster",
    "process_batch_rows": "keras_autoshard.runtime.cluster",
    "all_gather": _COLLECTIVES,
    "all_reduce": _COLLECTIVES,
    "broadcast": _COLLECTIVES,
    "copy_to_parallel": _COLLECTIVES,
    "reduce_from_parallel": _COLLECTIVES,
    "reduce_scatter": _COLLECTIVES,
    "scatter": _COLLECTIVES,
}

__all__ = list(_NAMES)

__getattr__, __dir__ = lazy_attributes(__name__, _NAMES)
