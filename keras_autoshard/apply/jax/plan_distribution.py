"""`PlanDistribution`: a Keras `Distribution` that serves a `ShardingPlan`."""

from __future__ import annotations

import logging

import keras
from keras.distribution import TensorLayout

from keras_autoshard.apply.jax.device_mesh import make_device_mesh
from keras_autoshard.compat import keras_private, keras_variables
from keras_autoshard.compat.keras_layouts import tensor_layout
from keras_autoshard.plans.identity import repeated_key
from keras_autoshard.plans.sharding_plan import (
    PlanError,
    ShardingPlan,
    check_mesh_matches,
)
from keras_autoshard.plans.validation import spec_problems

logger = logging.getLogger(__name__)


def require_jax_backend(what: str) -> None:
    """Raise unless Keras runs on JAX (the only backend this path supports)."""
    backend = keras.backend.backend()
    if backend != "jax":
        raise RuntimeError(
            f"{what} needs the JAX backend, but Keras is running on {backend!r}. "
            "Set KERAS_BACKEND=jax before importing Keras (the PyTorch and "
            "TensorFlow backends have their own entry points)."
        )


class PlanDistribution(keras_private.distribution_base()):
    """Apply a `ShardingPlan` through Keras's distribution hooks.

    Variables created under `scope()` take their planned layout as they are
    created (Keras shards large ones at initialisation and re-lays out small
    ones at once), optimizer slots inherit their parameter's layout, each
    batch is split along the plan's batch axis, and planned activation layouts
    are applied to layer outputs. XLA's SPMD partitioner inserts the
    communication.

    A trainable variable that the plan does not name is an error (a renamed
    layer must never fall back silently to replication). Non-trainable
    variables the plan does not name (optimizer counters, metric totals) are
    replicated and listed in `unplanned_variables`.

    Args:
        plan: The `ShardingPlan` to serve.
        device_mesh: A `keras.distribution.DeviceMesh` matching the plan's mesh;
            by default one is built from all devices.
        auto_shard_dataset: As in `keras.distribution.Distribution`.

    Example:

    ```python
    dist = PlanDistribution(plan)
    with dist.scope():
        model = build_model()
        keras_autoshard.rematerialize(model, plan)  # if plan.rematerialize
        model.compile(optimizer="adam", loss="mse")
        model.fit(x, y, epochs=1)
    ```
    """

    def __init__(
        self,
        plan: ShardingPlan,
        device_mesh: keras.distribution.DeviceMesh | None = None,
        auto_shard_dataset: bool = True,
    ):
        require_jax_backend("PlanDistribution")
        if device_mesh is None:
            device_mesh = make_device_mesh(plan.mesh)
        check_mesh_matches(plan.mesh, device_mesh)
        super().__init__(device_mesh, plan.batch_axis, auto_shard_dataset)
        self._plan = plan
        self._activation_layouts = {
            a.path: tensor_layout(a.spec, device_mesh) for a in plan.activations
        }
        self.unplanned_variables: list[str] = []
        # Path → ids of the variables created with it, where paths repeat.
        self._repeated_paths: dict[str, list[int]] = {}

    @property
    def plan(self) -> ShardingPlan:
        """The `ShardingPlan` this distribution serves."""
        return self._plan

    @property
    def num_model_replicas(self) -> int:
        if self.batch_dim_name is None:
            return 1
        return self._plan.mesh.axis_size(self.batch_dim_name)

    def get_data_layout(self, data_shape) -> TensorLayout:
        spec = [None] * len(data_shape)
        if self.batch_dim_name is not None and len(data_shape) > 0:
            batch_size = data_shape[0]
            axis_size = self.local_batch_axis_size()
            if batch_size is not None and batch_size % axis_size:
                raise PlanError(
                    f"Batch of size {batch_size} (input shape {tuple(data_shape)}) "
                    f"cannot be split over mesh axis {self.batch_dim_name!r} of "
                    f"size {axis_size} (this process's part of it). Use a batch "
                    f"size that is a multiple of {axis_size} (also for the last "
                    "batch: drop the remainder)."
                )
            spec[0] = self.batch_dim_name
        return tensor_layout(spec, self.device_mesh)

    def local_batch_axis_size(self) -> int:
        """Batch-axis positions this process feeds (all of them on one process)."""
        from keras_autoshard.runtime import jax_processes as multiprocess

        axis_size = self._plan.mesh.axis_size(self.batch_dim_name)
        if multiprocess.process_count() == 1:
            return axis_size
        shares, _ = multiprocess.batch_share(
            self.device_mesh.backend_mesh.devices,
            self._plan.mesh.axis_names,
            self.batch_dim_name,
        )
        return axis_size // shares

    def plan_key(self, variable) -> str:
        """The plan entry's key for `variable`: its path, or for a path several
        variables share, `<path>#<n>` by the order they are created in."""
        if self._plan.get(variable.path) is not None:
            return variable.path
        if self._plan.get(repeated_key(variable.path, 0)) is None:
            return variable.path
        created = self._repeated_paths.setdefault(variable.path, [])
        if id(variable) not in created:
            created.append(id(variable))
        return repeated_key(variable.path, created.index(id(variable)))

    def get_variable_layout(self, variable) -> TensorLayout:
        layout = keras_variables.variable_layout(variable)
        if layout is not None:
            return layout
        entry = self._plan.get(self.plan_key(variable))
        shape = tuple(int(s) for s in variable.shape)
        if entry is None:
            if variable.trainable:
                raise PlanError(
                    f"Trainable variable {variable.path!r} (shape {shape}) is not "
                    "in the sharding plan. The plan was made for a model whose "
                    "layers are named differently, or for another model. Re-plan "
                    "this model, or add the variable to the plan."
                )
            logger.debug("Replicating unplanned variable %s", variable.path)
            self.unplanned_variables.append(variable.path)
            return TensorLayout([None] * len(shape), self.device_mesh)
        if entry.shape != shape:
            raise PlanError(
                f"Variable {variable.path!r} has shape {shape} but the plan has "
                f"shape {entry.shape} for it. Re-plan this model."
            )
        problems = spec_problems(variable.path, shape, entry.spec, self._plan.mesh)
        if problems:
            raise PlanError("\n".join(problems))
        return tensor_layout(entry.spec, self.device_mesh)

    def get_tensor_layout(self, path: str) -> TensorLayout | None:
        return self._activation_layouts.get(path)

    def __repr__(self) -> str:
        return (
            f"<PlanDistribution mesh={self._plan.mesh.describe()} "
            f"variables={len(self._plan.variables)} batch_axis={self.batch_dim_name}>"
        )
