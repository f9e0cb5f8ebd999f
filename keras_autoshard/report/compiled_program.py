"""Compile a model's train and forward steps under a distribution and report.

The step functions are the ones `model.fit` / `model.predict` jit (same
function, same donation, same output shardings), lowered and compiled here
without running them.
"""

from __future__ import annotations

import jax
from keras.src.backend.jax.trainer import _distribute_data
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_autoshard.plans.sharding_plan import MeshSpec, unique_variables
from keras_autoshard.report.compiled_report import (
    CompiledReport,
    CompiledStep,
    VariableShards,
)
from keras_autoshard.report.hlo.collectives import parse_collectives

_MEMORY_FIELDS = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
}


def inspect_compiled(model, distribution, sample_batch) -> CompiledReport:
    """Compile one train step and one forward step and report what XLA made.

    Args:
        model: A compiled `keras.Model` created under `distribution.scope()`.
        distribution: The active `keras.distribution.Distribution`.
        sample_batch: `(x, y)` or `(x, y, sample_weight)` with the global batch.

    Returns:
        A `CompiledReport`.

    Example:

    ```python
    with dist.scope():
        model = build(); model.compile(optimizer="adam", loss="mse")
        report = inspect_compiled(model, dist, (x, y))
    print(report.table())
    ```
    """
    if model.optimizer is None:
        raise ValueError(
            "inspect_compiled needs a compiled model: call model.compile(...) "
            "under the distribution's scope first."
        )
    data = data_adapter_utils.unpack_x_y_sample_weight(tuple(sample_batch))
    if getattr(distribution, "is_planned", True) is False:
        # A distribution that plans itself (AutoShardDistribution) plans on
        # this batch first: its named planning step, as fit would take it.
        distribution.prepare(model, data[0])
    with distribution.scope():
        model._symbolic_build(data_batch=data)
        distributed = _distribute_data(data)
        train = _compile_train_step(model, distributed)
        forward = _compile_forward_step(model, distributed[0])
    device_ids = [d.id for d in _mesh_devices(distribution)]
    mesh = MeshSpec(
        tuple(distribution.device_mesh.shape), distribution.device_mesh.axis_names
    )
    return CompiledReport(
        mesh=mesh,
        parameters=tuple(
            _variable_shards(v, device_ids) for v in unique_variables(model.variables)
        ),
        optimizer_state=tuple(
            _variable_shards(v, device_ids) for v in model.optimizer.variables
        ),
        train_step=_step_report("train_step", train, mesh),
        forward_step=_step_report("forward_step", forward, mesh),
    )


def _compile_train_step(model, data):
    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    step = jax.jit(
        model.train_step,
        donate_argnums=0,
        out_shardings=(None, model._get_state_sharding_spec()),
    )
    return step.lower(state, data).compile()


def _compile_forward_step(model, x):
    trainable, non_trainable, _, _ = model._get_state_sharding_spec()

    def predict_step(state, data):
        outputs, non_trainable_values = model.predict_step(state, data)
        return outputs, (state[0], non_trainable_values)

    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True)
    step = jax.jit(
        predict_step,
        donate_argnums=0,
        out_shardings=(None, (trainable, non_trainable)),
    )
    return step.lower(state, (x,)).compile()


def _step_report(name: str, compiled, mesh: MeshSpec) -> CompiledStep:
    collectives = parse_collectives(compiled.as_text(), mesh.shape, mesh.axis_names)
    analysis = compiled.memory_analysis()
    memory = {
        key: int(getattr(analysis, attr))
        for key, attr in _MEMORY_FIELDS.items()
        if hasattr(analysis, attr)
    }
    return CompiledStep(name=name, collectives=tuple(collectives), memory=memory)


def _mesh_devices(distribution):
    return list(distribution.device_mesh.backend_mesh.devices.flat)


def _variable_shards(variable, device_ids) -> VariableShards:
    array = variable.value
    bytes_by_id = dict.fromkeys(device_ids, 0)
    for shard in array.addressable_shards:
        bytes_by_id[shard.device.id] = int(shard.data.nbytes)
    spec = tuple(array.sharding.spec) if hasattr(array.sharding, "spec") else ()
    spec = spec + (None,) * (array.ndim - len(spec))
    return VariableShards(
        path=variable.path,
        shape=tuple(int(s) for s in array.shape),
        dtype=str(array.dtype),
        spec=tuple(None if a is None else str(a) for a in spec),
        bytes_by_device=tuple(bytes_by_id[i] for i in device_ids),
    )
