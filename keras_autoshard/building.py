"""Building a model for planning or for comparison: `build_abstract` (the
variables' shapes, no weights) and `names_replayed_after` (a build whose
auto-generated names the next build reuses, so a plan keyed by variable path
fits both).

Imported lazily, like the package, so that `import keras_autoshard.building`
imports neither Keras nor JAX.

Example:

```python
import keras_autoshard as ka

backbone = ka.building.build_abstract(make_backbone)  # no weights
with ka.building.names_replayed_after():
    reference = build_model()
model = build_model()  # the same variable paths as `reference`
```
"""

import importlib

_NAMES = {
    "build_abstract": "keras_autoshard.trace.tracer",
    "names_replayed_after": "keras_autoshard.trace.naming",
}

__all__ = sorted(_NAMES)


def __getattr__(name):
    module_name = _NAMES.get(name)
    if module_name is None:
        raise AttributeError(
            f"module 'keras_autoshard.building' has no attribute {name!r}"
        )
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
