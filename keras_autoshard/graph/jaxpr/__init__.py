"""Jaxpr walking and the axis rules of JAX primitives, one module per family.

Importing this package registers every rule.
"""

from keras_autoshard.graph.jaxpr import (  # noqa: F401  (registers the rules)
    batched,
    contractions,
    control_flow,
    elementwise,
    fused_attention,
    indexing,
    reductions,
    views,
)
from keras_autoshard.graph.jaxpr.registry import handled_primitives  # noqa: F401
