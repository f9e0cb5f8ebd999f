"""Sharding strategies compared by the benchmarks: one registry entry each.

A strategy is a function `(build_model, mesh) -> Distribution | None`:
`build_model` builds the benchmark model (call it under
`names_replayed_after()` to inspect a model without changing the variable
paths of the next build), `mesh` is the (data, model) mesh to use, and `None`
means "no distribution: run on one device". A strategy that does not apply to
a model raises `StrategyNotApplicable`; the report prints "n/a" for it.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
from keras.src.distribution.distribution_lib import Distribution

from keras_autoshard import AutoShardDistribution, MeshSpec, PlanDistribution
from keras_autoshard.building import names_replayed_after
from keras_autoshard.testing.reference_plans import (
    ModelBuilder,
    handwritten_plan,
    keras_hub_layout_map,
)

Strategy = Callable[[ModelBuilder, MeshSpec], Distribution | None]


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


STRATEGIES: dict[str, Strategy] = {
    "single": single_device,
    "data_parallel": data_parallel,
    "handwritten": handwritten,
    "auto": auto,
    "keras_hub_map": keras_hub_layout_map,
}
