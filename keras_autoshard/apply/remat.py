"""Rematerialize the layers a plan names (JAX).

A rematerialized layer runs its call under `jax.checkpoint`: the backward
pass recomputes the call from its inputs instead of keeping its
intermediates. Keras's own `keras.RematScope(mode="list_of_layers")` cannot
be used for this on JAX (Keras 3.15): it checkpoints the call with every
argument traced, so a layer whose call takes `training` (every KerasHub
transformer layer) fails with a boolean conversion error on the traced
flag. `rematerialize` therefore gives each named layer of the model a
checkpointed `call` of its own (an attribute of that layer object; no Keras
class or module is changed) that traces only the array arguments and keeps
Python values (`training`, `None`, flags) static.

A layer whose call draws random numbers while training (dropout with a
non-zero rate) advances its seed generator, a state update Keras records in
the step's `StatelessScope`; inside the checkpoint that update is a value of
the checkpoint's own trace, which would escape it (JAX's
`UnexpectedTracerError`). The checkpointed call therefore returns the state
updates (and losses) its layers record as outputs of the checkpoint and
records them again outside it; the recomputation in the backward pass reads
the same seed, so it draws the same dropout masks.

The backward pass of a rematerialized call gives the gradients of its
inputs and of the variables it reads at once (an optimization barrier on
all of them): the previous layer's backward pass takes the input's gradient
only when this layer's weight gradients are made. Without it, XLA:GPU's
schedulers deferred a layer's weight gradients (needed only by the
optimizer) into the previous layer's backward pass, their operands live
beside its recomputed residuals: compiled for 8 H200s with XLA:GPU's
defaults, the zoo's rematerialized train steps took up to 39 % more memory
than with it, and 8x1 rows up to 6 % less
(`benchmarks/memory_truth_gpu.py`). XLA:CPU removes optimization barriers
before scheduling; its programs are the same either way.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import keras

from keras_autoshard.compat import keras_private
from keras_autoshard.plans.sharding_plan import PlanError, ShardingPlan


def rematerialize(model: keras.Model, plan: ShardingPlan | Sequence[str]) -> None:
    """Checkpoint the calls of the layers `plan.rematerialize` names.

    `AutoShardDistribution` and `TensorParallel` call this themselves; call
    it after building a model under a `PlanDistribution`.

    Args:
        model: The built model.
        plan: A `ShardingPlan`, or the layer names themselves.

    Raises:
        PlanError: When a name matches no layer of the model (a renamed
            layer must not silently lose its rematerialization), or on a
            backend other than JAX.

    Example:

    ```python
    with PlanDistribution(plan).scope():
        model = build_model()
    keras_autoshard.rematerialize(model, plan)
    ```
    """
    names = plan.rematerialize if isinstance(plan, ShardingPlan) else tuple(plan)
    if not names:
        return
    if keras.backend.backend() != "jax":
        raise PlanError(
            f"The plan rematerializes layers {list(names)}, which only the JAX "
            f"backend applies (Keras runs on {keras.backend.backend()!r}). Plan "
            "with a larger memory budget, or on JAX."
        )
    found = {name: _layer_at(model, name) for name in names}
    missing = sorted(name for name, layer in found.items() if layer is None)
    if missing:
        layers = sorted(layer.name for layer in keras_private.all_layers(model))
        raise PlanError(
            f"The plan rematerializes layers {missing}, which the model does not "
            f"have (its layers include {layers[:8]}). Plan this model again."
        )
    for layer in found.values():
        if not getattr(layer.call, "_keras_autoshard_checkpointed", False):
            layer.call = _checkpointed(layer.call)


def _layer_at(model: keras.Model, path: str):
    """The layer a plan names: a layer name, or names from an outer layer
    inward (`gpt2_backbone/transformer_layer_0`, `graph/blocks.py`);
    `None` when no single layer answers, a name that two layers share
    included (a renamed or duplicated layer must not take another's
    rematerialization)."""
    layer = model
    for name in path.split("/"):
        matches = [
            inner
            for inner in keras_private.all_layers(layer, include_self=False)
            if inner.name == name
        ]
        if len(matches) != 1:
            return None
        layer = matches[0]
    return layer


def _checkpointed(call):
    import jax

    @functools.wraps(call)
    def checkpointed_call(*args, **kwargs):
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        traced = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
        scope = keras_private.current_stateless_scope()
        recorded = _ScopeRecord(scope)

        def run(*arrays):
            filled = list(leaves)
            for index, array in zip(traced, arrays):
                filled[index] = array
            inner_args, inner_kwargs = jax.tree_util.tree_unflatten(treedef, filled)
            outputs = call(*inner_args, **inner_kwargs)
            return outputs, recorded.take_inner()

        arrays = tuple(leaves[i] for i in traced)
        # The variables the call reads (and any other value it closes over
        # that the gradient reaches) become explicit inputs, so that the
        # backward pass below returns their gradients too.
        call_of_arrays, closed_over = jax.closure_convert(run, *arrays)
        outputs, inner = _recomputed(call_of_arrays, *arrays, *closed_over)
        recorded.put_outer(inner)
        return outputs

    checkpointed_call._keras_autoshard_checkpointed = True
    return checkpointed_call


def _call(function, *primals):
    return function(*primals)


def _recompute_forward(function, *primals):
    """Forward: the call's outputs; keeps only its inputs for backward."""
    return function(*primals), primals


def _recompute_backward(function, primals, cotangents):
    """Backward: recompute the call (`jax.checkpoint`, so XLA cannot merge
    the recomputation into the forward pass) and give every input's
    gradient at once. The optimization barrier ties the gradients of the
    layer's variables to the gradient of its inputs: the previous layer's
    backward pass waits for them, so a scheduler cannot defer this layer's
    weight gradients (and keep their operands live) into it."""
    import jax

    _, pullback = jax.vjp(jax.checkpoint(function), *primals)
    gradients = list(pullback(cotangents))
    real = [i for i, g in enumerate(gradients) if g.dtype != jax.dtypes.float0]
    tied = jax.lax.optimization_barrier(tuple(gradients[i] for i in real))
    for index, gradient in zip(real, tied):
        gradients[index] = gradient
    return tuple(gradients)


@functools.cache
def _recomputed_call():
    """`function(*primals)`, differentiated by `_recompute_backward`."""
    import jax

    recomputed = jax.custom_vjp(_call, nondiff_argnums=(0,))
    recomputed.defvjp(_recompute_forward, _recompute_backward)
    return recomputed


def _recomputed(function, *primals):
    return _recomputed_call()(function, *primals)


class _ScopeRecord:
    """The state updates and losses a checkpointed call records in the
    step's `StatelessScope`, carried out of the checkpoint (see the module
    docstring)."""

    def __init__(self, scope):
        self.scope = scope
        self.before = dict(scope.state_mapping) if scope is not None else {}
        self.losses_before = len(scope.losses) if scope is not None else 0
        self.updated: list[int] = []

    def take_inner(self) -> tuple[tuple, tuple]:
        """Inside the checkpoint: remove what the call recorded, return it."""
        if self.scope is None:
            return (), ()
        mapping = self.scope.state_mapping
        self.updated = [
            key for key, value in mapping.items() if self.before.get(key) is not value
        ]
        values = tuple(mapping[key] for key in self.updated)
        for key in self.updated:
            if key in self.before:
                mapping[key] = self.before[key]
            else:
                del mapping[key]
        losses = tuple(self.scope.losses[self.losses_before :])
        del self.scope.losses[self.losses_before :]
        return values, losses

    def put_outer(self, inner: tuple[tuple, tuple]) -> None:
        """Outside the checkpoint: record its outputs in the scope again."""
        if self.scope is None:
            return
        values, losses = inner
        for key, value in zip(self.updated, values):
            self.scope.state_mapping[key] = value
        self.scope.losses.extend(losses)


def _is_array(value) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")
