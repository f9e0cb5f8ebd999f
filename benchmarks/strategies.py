"""Sharding strategies compared by the benchmarks: one registry entry each.

A strategy is a function `(build_model, mesh) -> Distribution | None`:
`build_model` builds the benchmark model (call it under
`names_replayed_after()` to inspect a model without changing the variable
paths of the next build), `mesh` is the (data, model) mesh to use, and `None`
means "no distribution: run on one device". A strategy that does not apply to
a model raises `StrategyNotApplicable`; the report prints "n/a" for it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import keras
from keras.src.distribution.distribution_lib import Distribution

from benchmarks.reference_rules import keras_hub_megatron_plan
from keras_autoshard import (
    AutoShardDistribution,
    MeshSpec,
    PlanDistribution,
    ShardingPlan,
    make_device_mesh,
    plan_from_rules,
)
from keras_autoshard.building import names_replayed_after

DATA_AXIS = "batch"
MODEL_AXIS = "model"

ModelBuilder = Callable[[], keras.Model]
Strategy = Callable[[ModelBuilder, MeshSpec], Distribution | None]

# Megatron column/row rules for the benchmark MLP block (non-KerasHub models).
MLP_MEGATRON_RULES = {
    "up/kernel": (None, MODEL_AXIS),
    "up/bias": (MODEL_AXIS,),
    "down/kernel": (MODEL_AXIS, None),
}


class StrategyNotApplicable(Exception):
    """This strategy has nothing to offer for this model (reported as n/a)."""


def single_device(build_model: ModelBuilder, mesh: MeshSpec) -> None:
    """No distribution: the whole model on one device (the timing baseline)."""
    del build_model, mesh
    return None


def data_parallel(build_model: ModelBuilder, mesh: MeshSpec) -> Distribution:
    """Keras `DataParallel` over all the mesh's devices (mesh axis "batch")."""
    del build_model
    devices = keras.distribution.list_devices()[: mesh.device_count]
    return keras.distribution.DataParallel(devices=devices)


def handwritten(build_model: ModelBuilder, mesh: MeshSpec) -> Distribution:
    """The hand-written Megatron plan (see `handwritten_plan`)."""
    with names_replayed_after():
        reference = build_model()
    return PlanDistribution(handwritten_plan(reference, mesh))


def auto(build_model: ModelBuilder, mesh: MeshSpec) -> Distribution:
    """`AutoShardDistribution`: planned from the graph on the first batch."""
    del build_model
    return AutoShardDistribution(device_mesh=mesh)


def keras_hub_layout_map(build_model: ModelBuilder, mesh: MeshSpec) -> Distribution:
    """`ModelParallel` with the backbone class's own `get_layout_map`, if any."""
    with names_replayed_after():
        reference = build_model()
    get_layout_map = getattr(type(reference), "get_layout_map", None)
    if get_layout_map is None:
        raise StrategyNotApplicable(f"{type(reference).__name__} has no get_layout_map")
    layout_map = get_layout_map(
        make_device_mesh(mesh),
        model_parallel_dim_name=MODEL_AXIS,
        data_parallel_dim_name=DATA_AXIS,
    )
    _check_layouts_divide(reference, layout_map, mesh)
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name=DATA_AXIS
    )


def _check_layouts_divide(
    model: keras.Model, layout_map: keras.distribution.LayoutMap, mesh: MeshSpec
) -> None:
    """Raise `StrategyNotApplicable` where the map shards a dim it cannot split.

    Keras would fail while building the model; the report lists the reason.
    """
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    for variable in model.variables:
        layout = layout_map[variable.path]
        if layout is None:
            continue
        for dim, (size, axis) in enumerate(zip(variable.shape, layout.axes)):
            if axis is not None and size % sizes[axis]:
                raise StrategyNotApplicable(
                    f"the KerasHub layout map shards dim {dim} (size {size}) of "
                    f"{variable.path!r} over {axis!r} ({sizes[axis]} devices), "
                    "which does not divide it"
                )


def handwritten_plan(model: keras.Model, mesh: MeshSpec) -> ShardingPlan:
    """The Megatron plan an engineer writes by hand for `model`.

    KerasHub backbones get `keras_hub_megatron_plan`; other models get the
    column/row rules of the benchmark MLP block (`MLP_MEGATRON_RULES`).

    Args:
        model: A built model.
        mesh: A mesh with "batch" and "model" axes.

    Returns:
        The plan.
    """
    if _is_keras_hub_backbone(model):
        return keras_hub_megatron_plan(
            model, mesh, model_axis=MODEL_AXIS, batch_axis=DATA_AXIS
        )
    return plan_from_rules(
        model.variables, mesh, MLP_MEGATRON_RULES, batch_axis=DATA_AXIS
    )


def _is_keras_hub_backbone(model: keras.Model) -> bool:
    # A model can only be a KerasHub backbone if KerasHub was imported to
    # build it; checking first keeps MLP-only runs from importing it.
    if "keras_hub" not in sys.modules:
        return False
    import keras_hub

    return isinstance(model, keras_hub.models.Backbone)


STRATEGIES: dict[str, Strategy] = {
    "single": single_device,
    "data_parallel": data_parallel,
    "handwritten": handwritten,
    "auto": auto,
    "keras_hub_map": keras_hub_layout_map,
}
