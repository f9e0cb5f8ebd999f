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

from keras_autoshard.lazy_names import lazy_attributes

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

__getattr__, __dir__ = lazy_attributes(__name__, _TYPES)
