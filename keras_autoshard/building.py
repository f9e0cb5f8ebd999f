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

from keras_autoshard.lazy_names import lazy_attributes

_NAMES = {
    "build_abstract": "keras_autoshard.trace.tracer",
    "names_replayed_after": "keras_autoshard.trace.naming",
}

__all__ = sorted(_NAMES)

__getattr__, __dir__ = lazy_attributes(__name__, _NAMES)
