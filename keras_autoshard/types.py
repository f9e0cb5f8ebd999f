"""The data the public API returns and takes, for annotations and
`isinstance`: plan parts (`VariableSharding`, `ActivationLayout`,
`PlanEstimate`), reports (`CompiledReport`, `TargetCompile`, `LoadReport`,
`RestoredCheckpoint`) and the cluster a process joined (`ClusterSpec`).

Imported lazily, like the package, so that `import keras_autoshard.types`
imports neither Keras nor JAX.

Example:

```python
from keras_autoshard.types import VariableSharding

def cut(entry: VariableSharding) -> bool:
    return any(entry.spec)
```
"""

import importlib

_TYPES = {
    "ActivationLayout": "keras_autoshard.plans.sharding_plan",
    "VariableSharding": "keras_autoshard.plans.sharding_plan",
    "PlanEstimate": "keras_autoshard.plans.estimate",
    "CompiledReport": "keras_autoshard.report.compiled_report",
    "TargetCompile": "keras_autoshard.apply.jax.target_compile",
    "LoadReport": "keras_autoshard.checkpoint.sharded_load",
    "RestoredCheckpoint": "keras_autoshard.checkpoint.orbax_restore",
    "ClusterSpec": "keras_autoshard.runtime.cluster",
}

__all__ = sorted(_TYPES)


def __getattr__(name):
    module_name = _TYPES.get(name)
    if module_name is None:
        raise AttributeError(
            f"module 'keras_autoshard.types' has no attribute {name!r}"
        )
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_TYPES))
