"""A model with no `call` of its own, traced through the sub-models it holds.

A GAN, or any model whose custom `train_step` calls its sub-models itself
(keras.io's pattern: a generator and a discriminator, each with its own
optimizer), has no forward pass to trace: `keras.Model.call` raises. Its
parts are the direct child layers that own variables; each is traced on its
own batch, as one forward pass whose inputs and outputs are keyed by the
part's name. What the train step does between the parts (a concatenation of
generated and real rows, the losses) is not seen; the plan's notes say so.

A part's batch is the `sample_input` entry named after it (a dict keyed by
part names), else a batch shaped as the part declares (a functional model's
`inputs`) with as many rows as the leading dim of `sample_input`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
import keras
import numpy as np

from keras_autoshard.errors import PlanError


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """The sub-models traced in place of a model's missing `call`.

    Args:
        layers: Part name → the child layer.
        inputs: Part name → its batch (`jax.ShapeDtypeStruct` leaves).
        note: What the plan's notes say about tracing the parts.
    """

    layers: dict[str, keras.Layer]
    inputs: dict[str, Any]
    note: str


def has_own_call(model: keras.Model) -> bool:
    """Whether `model` defines a forward pass (a subclass's `call`, or a
    functional or sequential graph), rather than `keras.Model.call`'s
    `NotImplementedError`."""
    return type(model).call is not keras.Model.call


def model_parts(model: keras.Model, sample_input) -> ModelParts:
    """The parts of a model with no `call`, and the batch each is traced on.

    Args:
        model: A `keras.Model` whose class defines no `call`.
        sample_input: A dict keyed by part names (each part's batch), or
            one batch whose leading dim gives the rows of every part's
            declared inputs.

    Returns:
        A `ModelParts`.

    Raises:
        PlanError: The model holds no layer with variables, a part is not
            built, or a part's batch cannot be known (it declares no inputs
            and `sample_input` does not name it): the message names the part
            and says what to pass.
    """
    children = [layer for layer in model.layers if layer.variables]
    where = (
        f"Model {model.name!r} ({type(model).__name__}) has no call() of its own "
        "(its train step calls its sub-models itself)"
    )
    if not children:
        raise PlanError(
            f"{where} and holds no layer with variables to trace in its place. "
            "Give the model a call(), or plan the model its train step calls."
        )
    unbuilt = [layer.name for layer in children if not layer.built]
    if unbuilt:
        raise PlanError(
            f"{where}; its parts {unbuilt} are not built. Build them (call "
            "each on a batch, or give them keras.Input shapes) before planning."
        )
    names = [layer.name for layer in children]
    if isinstance(sample_input, dict) and set(sample_input) & set(names):
        unknown = sorted(set(sample_input) - set(names))
        if unknown:
            raise PlanError(
                f"{where}: sample_input names {unknown}, which are not among its "
                f"parts {names}. Key each part's batch by the part's name."
            )
        given = dict(sample_input)
        rows = None
    else:
        given = {}
        rows = _leading_rows(model, sample_input)
    inputs = {
        layer.name: given[layer.name]
        if layer.name in given
        else _declared_batch(layer, rows, where)
        for layer in children
    }
    described = ", ".join(
        f"{name!r} on {_shapes(batch)}" for name, batch in inputs.items()
    )
    note = (
        f"{where}: planned from its parts, each on its own batch ({described}). "
        "What the train step does between them (a concatenation of their "
        "batches, the losses) is not traced; each part's batch is cut as "
        "its own layers allow."
    )
    return ModelParts(dict(zip(names, children)), inputs, note)


def parts_forward(parts: ModelParts, trainable, non_trainable):
    """A forward function over the model's variable values: each part's
    `stateless_call` on its batch (as a JAX train step calls it), outputs
    keyed by part name.

    Args:
        parts: The model's `ModelParts`.
        trainable: The model's trainable variables, in the order of the
            forward function's first argument.
        non_trainable: Its non-trainable variables, in the order of the
            second.

    Returns:
        `forward(trainable_values, non_trainable_values, inputs)`.
    """

    def forward(trainable_values, non_trainable_values, inputs):
        values = {id(v): value for v, value in zip(trainable, trainable_values)}
        values.update(
            {id(v): value for v, value in zip(non_trainable, non_trainable_values)}
        )
        outputs = {}
        for name, layer in parts.layers.items():
            kwargs = {"training": True} if call_takes_training(layer) else {}
            outputs[name], _ = layer.stateless_call(
                [values[id(v)] for v in layer.trainable_variables],
                [values[id(v)] for v in layer.non_trainable_variables],
                inputs[name],
                **kwargs,
            )
        return outputs

    return forward


def _leading_rows(model: keras.Model, sample_input) -> int:
    leaves = jax.tree_util.tree_leaves(sample_input)
    if not leaves or not np.shape(leaves[0]):
        raise PlanError(
            f"Model {model.name!r} has no call() of its own: sample_input must "
            "be a batch (its leading dim gives the rows of each part's batch) "
            "or a dict keyed by part names."
        )
    return int(np.shape(leaves[0])[0])


def _declared_batch(layer: keras.Layer, rows: int | None, where: str):
    declared = getattr(layer, "inputs", None)
    if rows is None or not declared:
        raise PlanError(
            f"{where}: its part {layer.name!r} ({type(layer).__name__}) declares no "
            "inputs, so its batch is unknown. Pass sample_input as a dict keyed by "
            f"part names, e.g. {{{layer.name!r}: batch, ...}}."
        )

    def struct(tensor):
        shape = tuple(tensor.shape)[1:]
        if any(size is None for size in shape):
            raise PlanError(
                f"{where}: its part {layer.name!r} declares an input of shape "
                f"{tuple(tensor.shape)}, with a size other than the batch left "
                f"open. Pass sample_input={{{layer.name!r}: batch, ...}}."
            )
        return jax.ShapeDtypeStruct((rows, *shape), np.dtype(tensor.dtype))

    return jax.tree_util.tree_map(struct, layer.input)


def _shapes(batch) -> str:
    shapes = [tuple(np.shape(leaf)) for leaf in jax.tree_util.tree_leaves(batch)]
    return str(shapes[0]) if len(shapes) == 1 else str(shapes)


def call_takes_training(layer: keras.Layer) -> bool:
    """Whether `layer.call` has a `training` argument."""
    try:
        return "training" in inspect.signature(layer.call).parameters
    except (TypeError, ValueError):
        return False
