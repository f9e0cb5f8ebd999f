"""Data parallelism on TensorFlow: `tf.distribute.MirroredStrategy` over the
local devices, and the check that refuses anything it cannot run correctly.

Keras 3 trains under a `tf.distribute` strategy natively when the model is
created and compiled inside `strategy.scope()`: each replica gets its slice of
the global batch, its loss is scaled by the global batch size, and the
gradients are summed across replicas, so the update equals the one-device
update on the whole batch. What this backend cannot do is keep a variable cut
over devices: a plan or mesh asking for that raises
`TensorFlowModelParallelError`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence

import keras
import tensorflow as tf

from keras_autoshard.apply.auto_distribution import AutoShardDistribution
from keras_autoshard.apply.tensor_parallel_setup import (
    TensorParallelError,
    select_devices,
)
from keras_autoshard.errors import TensorFlowModelParallelError  # noqa: F401
from keras_autoshard.plans.mesh import DATA_AXIS_NAMES, DEFAULT_AXIS_NAMES
from keras_autoshard.plans.rules import Spec
from keras_autoshard.plans.sharding_plan import MeshSpec, PlanError, ShardingPlan
from keras_autoshard.plans.units import optional_byte_size

logger = logging.getLogger(__name__)

ALTERNATIVES = (
    "For tensor parallelism set KERAS_BACKEND=jax (or KERAS_BACKEND=torch and "
    "launch with torchrun) before importing Keras; on TensorFlow use data "
    "parallelism only (TensorParallel(model, world_size=1), or a mesh whose "
    "model axis is 1). See docs/tensorflow.md."
)
WHY = (
    "the TensorFlow backend cannot keep a variable cut over devices correctly: "
    "Keras's TensorFlow distribution is a prototype that leaves every variable "
    "whole, and tf.experimental.dtensor layouts trained to wrong losses without "
    "an error for sharded Embedding/EinsumDense models"
)


def data_parallel_strategy(
    device_ids: Sequence[str | int] | None = None,
) -> tf.distribute.MirroredStrategy:
    """A `MirroredStrategy` over local devices, named as Keras names them.

    Args:
        device_ids: Devices (`"gpu:0"`, `"cpu:1"`) or indices into
            `keras.distribution.list_devices()`; `None` for all of them
            (accelerators when there are any, else the logical CPU devices).

    Returns:
        A `tf.distribute.MirroredStrategy` with one replica per device.

    Raises:
        TensorParallelError: a device that does not exist, or a repeated one.

    Example:

    ```python
    strategy = data_parallel_strategy()
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=64)   # each of N replicas gets 64 / N rows
    ```
    """
    devices = select_devices(device_ids)
    # On CPUs MirroredStrategy defaults to CollectiveAllReduce, whose
    # collective keys collide between two strategies in one process ("Collective
    # instance 101 expected type 0 ... but got type 2") once a model has
    # Embedding (IndexedSlices) gradients; summing on one host device is exact.
    on_cpu = all(name.lower().startswith("cpu") for name in devices)
    return tf.distribute.MirroredStrategy(
        [f"/{name}" for name in devices],
        cross_device_ops=tf.distribute.ReductionToOneDevice() if on_cpu else None,
    )


def check_data_parallel_mesh(mesh: MeshSpec, what: str) -> None:
    """Raise unless every axis of `mesh` larger than 1 splits the batch.

    Args:
        mesh: The requested mesh.
        what: What asked for it, for the message.

    Raises:
        TensorFlowModelParallelError: a model (non-data) axis larger than 1.
    """
    model_axes = {
        name: size
        for name, size in zip(mesh.axis_names, mesh.shape)
        if name not in DATA_AXIS_NAMES and size > 1
    }
    if model_axes:
        axes = ", ".join(f"{name}={size}" for name, size in model_axes.items())
        raise TensorFlowModelParallelError(
            f"{what} asks for tensor parallelism (mesh {mesh.describe()}; model "
            f"axis {axes}), but {WHY}. {ALTERNATIVES}"
        )


def check_data_parallel_plan(plan: ShardingPlan, cuts_required: bool = True) -> None:
    """Raise unless `plan` can run as pure data parallelism.

    A plan on a data-only mesh may still cut some variables over the data
    axis for storage (FSDP-style) where that saves communication on JAX.
    `MirroredStrategy` keeps every variable whole; when no memory budget or
    rule asked for those cuts (`cuts_required=False`) the math is the same,
    so they are dropped with a warning naming them.

    Args:
        plan: A plan for the model about to train under `MirroredStrategy`.
        cuts_required: Whether a memory budget or user rules asked for the
            plan's cuts (then a cut is an error).

    Raises:
        TensorFlowModelParallelError: the plan's mesh has a model axis larger
            than 1, or the plan cuts a variable that a budget or rule needs cut.
    """
    check_data_parallel_mesh(plan.mesh, "The plan")
    sharded = [v for v in plan.variables if any(axis for axis in v.spec)]
    shown = ", ".join(f"{v.path} {v.spec}" for v in sharded[:3])
    more = f" and {len(sharded) - 3} more" if len(sharded) > 3 else ""
    if sharded and not cuts_required:
        logger.warning(
            "TensorFlow keeps %d variable(s) whole on every device that the plan "
            "cuts over the data axis for storage (%s%s): MirroredStrategy "
            "replicates variables. Results are the same; memory per device is "
            "higher than the plan says. Use KERAS_BACKEND=jax for the cut.",
            len(sharded),
            shown,
            more,
        )
        return
    if sharded:
        raise TensorFlowModelParallelError(
            f"The plan cuts {len(sharded)} variable(s) over devices ({shown}{more}), "
            f"but {WHY}. Raise memory_budget (or drop the rules that cut "
            f"variables) so every variable stays whole. {ALTERNATIVES}"
        )


def cuts_asked(memory_budget, rules) -> bool:
    """Whether a memory budget or a rule that cuts a dimension was given."""
    pinned_cuts = any(any(axis for axis in spec) for spec in (rules or {}).values())
    return memory_budget is not None or pinned_cuts


def data_parallel_mesh(device_mesh, device_count: int) -> MeshSpec:
    """The (data, model=1) mesh to run on: `device_mesh` checked, or the default.

    Args:
        device_mesh: `None`, a `MeshSpec` or a `keras.distribution.DeviceMesh`.
        device_count: Devices available.

    Returns:
        A `MeshSpec` whose only axes larger than 1 are data axes.

    Raises:
        TensorFlowModelParallelError: the mesh has a model axis larger than 1.
        TensorParallelError: the mesh needs more devices than there are.
    """
    if device_mesh is None:
        return MeshSpec((device_count, 1), DEFAULT_AXIS_NAMES)
    mesh = (
        device_mesh
        if isinstance(device_mesh, MeshSpec)
        else MeshSpec(tuple(device_mesh.shape), tuple(device_mesh.axis_names))
    )
    check_data_parallel_mesh(mesh, "AutoShardDistribution")
    if mesh.device_count > device_count:
        raise TensorParallelError(
            f"Mesh {mesh.describe()} needs {mesh.device_count} devices but "
            f"{device_count} are available. Without accelerators, make more "
            "with tf.config.set_logical_device_configuration before TensorFlow "
            "starts."
        )
    return mesh


class TensorFlowAutoShardDistribution(AutoShardDistribution):
    """`AutoShardDistribution` under the TensorFlow backend: data parallelism.

    `keras_autoshard.AutoShardDistribution(...)` returns one of these when
    Keras runs on TensorFlow. `scope()` is a `tf.distribute.MirroredStrategy`
    scope over the mesh's devices: build and compile the model inside it and
    Keras splits each batch over the replicas. `prepare(model, x)` plans the
    model (in a JAX subprocess) and checks that the plan keeps every variable
    whole; it is not done on the first batch, since data parallelism needs
    no plan to run.

    Args:
        device_mesh: `None` (every device on a data axis), or a `MeshSpec` /
            `keras.distribution.DeviceMesh` whose axes larger than 1 are all
            data axes (`"batch"`, `"data"`, ...).
        memory_budget: Per-device bytes (a number, or a string such as
            `"16GiB"`) for parameters and optimizer state,
            checked by `prepare`.
        rules: Regular expression on variable path → spec, for `prepare`.
        sample_input: A batch for `prepare` when none is given there.
        auto_shard_dataset: Unused on TensorFlow (`tf.distribute` splits
            each batch); accepted for the same signature.
        sequence_parallel: Must be `False`: there is no tensor-parallel
            axis to cut activations over (a `PlanError` says so).

    Raises:
        TensorFlowModelParallelError: the mesh has a model axis larger than 1.

    Example:

    ```python
    dist = keras_autoshard.AutoShardDistribution()   # KERAS_BACKEND=tensorflow
    with dist.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="mse")
    dist.prepare(model, x[:64])    # optional: the plan, checked
    model.fit(x, y, batch_size=64)
    ```
    """

    def __init__(
        self,
        device_mesh=None,
        memory_budget: int | str | None = None,
        rules: Mapping[str, Spec] | None = None,
        sample_input=None,
        auto_shard_dataset: bool = True,
        sequence_parallel: bool = False,
    ):
        if sequence_parallel:
            raise PlanError(
                "sequence_parallel=True cuts activations over a "
                "tensor-parallel axis, and the TensorFlow backend runs data "
                "parallel only. Use the JAX backend (KERAS_BACKEND=jax) for "
                "sequence parallelism, or drop sequence_parallel."
            )
        devices = keras.distribution.list_devices()
        self._mesh = data_parallel_mesh(device_mesh, len(devices))
        self._devices = tuple(devices[: self._mesh.device_count])
        self._memory_budget = optional_byte_size(memory_budget)
        self._rules = dict(rules) if rules else None
        self._sample_input = sample_input
        self._plan: ShardingPlan | None = None
        self.strategy = data_parallel_strategy(self._devices)

    @property
    def mesh(self) -> MeshSpec:
        """The data-parallel mesh (its model axis is 1)."""
        return self._mesh

    @property
    def devices(self) -> tuple[str, ...]:
        return self._devices

    @property
    def is_planned(self) -> bool:
        return self._plan is not None

    @property
    def plan(self) -> ShardingPlan:
        if self._plan is None:
            raise PlanError(
                "No plan yet: under TensorFlow the plan is made by "
                "prepare(model, sample_input), not on the first batch."
            )
        return self._plan

    def prepare(self, model: keras.Model, sample_input=None) -> ShardingPlan:
        """Plan `model` on this mesh and check the plan keeps variables whole.

        Args:
            model: A built model.
            sample_input: One global batch of inputs (or their shapes).

        Returns:
            The `ShardingPlan` (every variable replicated).

        Raises:
            TensorFlowModelParallelError: the plan cuts a variable.
            PlanError: no sample input, or the model cannot be planned.
        """
        from keras_autoshard.apply.tensorflow.planning import plan_for_tensorflow

        sample_input = sample_input if sample_input is not None else self._sample_input
        if sample_input is None:
            raise PlanError("prepare() needs sample_input (one batch of inputs).")
        plan = plan_for_tensorflow(
            model,
            self._mesh,
            sample_input,
            memory_budget=self._memory_budget,
            rules=self._rules,
        )
        check_data_parallel_plan(
            plan, cuts_required=cuts_asked(self._memory_budget, self._rules)
        )
        self._plan = plan
        return plan

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The `MirroredStrategy` scope: create and compile models inside it."""
        with self.strategy.scope():
            yield

    def __repr__(self) -> str:
        return (
            f"<AutoShardDistribution (TensorFlow, MirroredStrategy) "
            f"mesh={self._mesh.describe()} devices={list(self._devices)}>"
        )
