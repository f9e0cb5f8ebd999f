"""`JaxAutoShardDistribution`: the JAX `AutoShardDistribution`, which plans itself.

Variables created under its scope before a plan exists get a provisional
sharded layout (their largest divisible dimension cut over the largest mesh
axis), so no full copy of a large model is kept on every device. When the
model's input shapes are known (the first batch of `fit`, `evaluate`,
`predict`, `train_on_batch`, or an explicit `prepare(model, sample_input)`),
it plans from the model's graph and re-lays every variable out onto the plan,
shard to shard.
"""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from collections.abc import Mapping

import jax
import keras
from keras.distribution import TensorLayout

from keras_autoshard.apply.auto_distribution import AutoShardDistribution
from keras_autoshard.apply.jax.device_mesh import default_mesh_shape, make_device_mesh
from keras_autoshard.apply.jax.plan_distribution import (
    PlanDistribution,
    require_jax_backend,
)
from keras_autoshard.apply.jax.trainer_calls import (
    check_batch_sizes,
    trainer_call_asking,
)
from keras_autoshard.apply.optimizer_slots import slot_owner, slot_prefix
from keras_autoshard.apply.remat import rematerialize
from keras_autoshard.compat import keras_globals, keras_private, keras_variables
from keras_autoshard.compat.keras_layouts import tensor_layout
from keras_autoshard.plans.identity import unique_variables, variable_keys
from keras_autoshard.plans.mesh import (
    DATA_AXIS,
    DATA_AXIS_NAMES,
    DEFAULT_AXIS_NAMES,
    MODEL_AXIS,
    Spec,
)
from keras_autoshard.plans.sharding_plan import MeshSpec, PlanError, ShardingPlan
from keras_autoshard.plans.units import optional_byte_size

logger = logging.getLogger(__name__)


class JaxAutoShardDistribution(AutoShardDistribution):
    """The JAX side of `keras_autoshard.AutoShardDistribution`.

    Serves Keras the layouts of the plan; until a model is planned, variables
    get a provisional sharded layout and batches stay whole. A model is
    planned on the first batch Keras distributes for it (see
    `get_data_layout`), or by `prepare(model, sample_input)`.
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
        require_jax_backend("AutoShardDistribution")
        self._requested_mesh = _as_mesh_spec(device_mesh)
        devices = keras.distribution.list_devices()
        provisional = self._requested_mesh or MeshSpec(
            (1, len(devices)), (DATA_AXIS, MODEL_AXIS)
        )
        keras_mesh = (
            device_mesh
            if isinstance(device_mesh, keras.distribution.DeviceMesh)
            else make_device_mesh(provisional)
        )
        super().__init__(keras_mesh, None, auto_shard_dataset)
        self._memory_budget = optional_byte_size(memory_budget)
        self._rules = dict(rules) if rules else None
        self._sample_input = sample_input
        self._sequence_parallel = sequence_parallel
        # `plan()`'s `batch_over_model_axes`; `TensorParallel` keeps its
        # model axis for the model.
        self._batch_over_model_axes = True
        self._applied: PlanDistribution | None = None
        # Models planned by this distribution (weakly held: no model is kept
        # alive by having been planned) and those being planned right now.
        self._planned_models: weakref.WeakSet = weakref.WeakSet()
        self._planning_models: weakref.WeakSet = weakref.WeakSet()
        self._stale_step_functions: weakref.WeakSet = weakref.WeakSet()
        self._warned_batch_whole = False
        self._plans_shared = 0

    # ------------------------------------------------------------- the plan
    @property
    def plan(self) -> ShardingPlan:
        """The applied plan; `PlanError` before the model has been planned."""
        if self._applied is None:
            raise PlanError(
                "No plan yet: it is made when the model first sees a batch "
                "(fit/evaluate/predict/train_on_batch) or on prepare(model, x)."
            )
        return self._applied.plan

    @property
    def is_planned(self) -> bool:
        """Whether a plan has been made and applied."""
        return self._applied is not None

    def prepare(self, model: keras.Model, sample_input=None) -> ShardingPlan:
        """Plan `model` now and move its variables onto the plan.

        Args:
            model: A built model created under this distribution's scope.
            sample_input: One global batch of inputs (or their shapes).

        Returns:
            The `ShardingPlan` now applied.
        """
        from keras_autoshard.planner.planner import plan as make_plan

        sample_input = sample_input if sample_input is not None else self._sample_input
        if sample_input is None:
            raise PlanError("prepare() needs sample_input (one batch of inputs).")
        if multi_process():
            plan = self._plan_across_processes(model, sample_input)
        else:
            plan = make_plan(
                model,
                device_mesh=self._requested_mesh,
                sample_input=sample_input,
                memory_budget=self._memory_budget,
                rules=self._rules,
                sequence_parallel=self._sequence_parallel,
                batch_over_model_axes=self._batch_over_model_axes,
            )
        self._apply(plan, model)
        self._planned_models.add(model)
        return plan

    def _plan_across_processes(self, model, local_sample) -> ShardingPlan:
        """Process 0 plans for the global batch; every process applies its plan.

        Each process sees only its rows of a batch; the plan is made for the
        global batch those rows are part of, on a mesh whose model axis stays
        within a process (tensor parallelism inside a host, data parallelism
        across hosts) unless a mesh was given.
        """
        from keras_autoshard.planner.planner import plan as make_plan
        from keras_autoshard.runtime import jax_processes as multiprocess

        mesh = self._requested_mesh or MeshSpec(
            default_mesh_shape(
                len(keras.distribution.list_devices()),
                math.gcd(multiprocess.local_device_count(), 8),
            ),
            DEFAULT_AXIS_NAMES,
        )
        data_axes = [name for name in mesh.axis_names if name in DATA_AXIS_NAMES]
        batch_axis = data_axes[0] if data_axes else None
        shares, _ = multiprocess.batch_share(
            make_device_mesh(mesh).backend_mesh.devices, mesh.axis_names, batch_axis
        )
        plan_json = None
        if multiprocess.process_index() == 0:
            global_sample = multiprocess.global_batch_shapes(local_sample, shares)
            plan_json = make_plan(
                model,
                device_mesh=mesh,
                sample_input=global_sample,
                memory_budget=self._memory_budget,
                rules=self._rules,
                sequence_parallel=self._sequence_parallel,
                batch_over_model_axes=self._batch_over_model_axes,
            ).to_json()
        self._plans_shared += 1
        shared = multiprocess.share_text_from_process_0(
            f"{self._plans_shared}", plan_json
        )
        plan = ShardingPlan.from_json(shared)
        if shares > 1 and plan.batch_axis != batch_axis:
            raise PlanError(
                f"The plan splits the batch over {plan.batch_axis!r}, but each "
                f"process loads its rows of the batch as split over {batch_axis!r} "
                f"(mesh {mesh.describe()}). Name the data axis of the mesh first."
            )
        return plan

    def _apply(self, plan: ShardingPlan, model: keras.Model) -> None:
        device_mesh = (
            self.device_mesh
            if tuple(self.device_mesh.shape) == plan.mesh.shape
            and tuple(self.device_mesh.axis_names) == plan.mesh.axis_names
            else make_device_mesh(plan.mesh)
        )
        applied = PlanDistribution(plan, device_mesh)
        plan.validate(model)
        self._device_mesh = device_mesh
        self._batch_dim_name = plan.batch_axis
        self._applied = applied
        relayout_model(model, applied)
        rematerialize(model, plan)
        self._warn_if_batch_kept_whole(plan)

    def _warn_if_batch_kept_whole(self, plan: ShardingPlan) -> None:
        """Say once, loudly, when the plan leaves the batch whole on a data
        axis (the plan's notes say why)."""
        whole = [note for note in plan.notes if note.startswith("The batch of")]
        if whole and not self._warned_batch_whole:
            self._warned_batch_whole = True
            warnings.warn(" ".join(whole), stacklevel=3)

    # ------------------------------------------------- Distribution protocol
    @property
    def num_model_replicas(self) -> int:
        if self._applied is not None:
            return self._applied.num_model_replicas
        # Before the plan (when Keras shards a tf.data pipeline per process),
        # the batch will be split over the mesh's first data axis.
        sizes = dict(zip(self.device_mesh.axis_names, self.device_mesh.shape))
        data_axes = [name for name in sizes if name in DATA_AXIS_NAMES]
        return sizes[data_axes[0]] if data_axes else 1

    def get_data_layout(self, data_shape) -> TensorLayout:
        """The layout of one batch tensor; plans the model on its first batch.

        Keras asks for data layouts when a trainer method (`fit`, `evaluate`,
        `predict`, the `*_on_batch` methods) distributes a batch. When the
        model behind that call has not been planned yet, it is planned here,
        on that batch, before Keras records its state shardings (found by
        `trainer_call_asking`), and checks that every batch of the call
        (the first, the last) splits over the data axis.
        """
        call = trainer_call_asking()
        if call is not None and call.batch is not None:
            self._plan_on_first_batch(call.model, call.batch)
            self._remake_stale_step_functions(call.model)
        if call is not None and self._applied is not None:
            axis = self._applied.batch_dim_name
            if axis is not None:
                size = self._applied.local_batch_axis_size()
                check_batch_sizes(call, data_shape, axis, size)
        if self._applied is None:
            # No plan and no trainer call to plan from: keep the batch whole.
            return TensorLayout([None] * len(data_shape), self.device_mesh)
        return self._applied.get_data_layout(data_shape)

    def _plan_on_first_batch(self, model: keras.Model, batch) -> None:
        if model in self._planned_models or model in self._planning_models:
            return
        x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
        self._planning_models.add(model)
        try:
            if not model.built:
                # Build symbolically (shapes only), as Keras's own build does.
                keras_private.compute_output_spec(model, symbolic_inputs(x))
            self.prepare(model, x)
        finally:
            self._planning_models.discard(model)
        self._stale_step_functions.add(model)

    def _remake_stale_step_functions(self, model: keras.Model) -> None:
        """Step functions compiled before the plan output the old shardings:
        remake them once the model's variables hold values again (inside
        `predict` Keras has moved them into its loop state)."""
        if model not in self._stale_step_functions or not all(
            keras_variables.has_value(variable) for variable in model.variables
        ):
            return
        self._stale_step_functions.discard(model)
        for function, make in (
            (model.train_function, model.make_train_function),
            (model.test_function, model.make_test_function),
            (model.predict_function, model.make_predict_function),
        ):
            if function is not None:
                make(force=True)

    def get_variable_layout(self, variable) -> TensorLayout:
        layout = keras_variables.variable_layout(variable)
        if layout is not None:
            return layout
        if self._applied is not None and self._applied.plan.get(
            self._applied.plan_key(variable)
        ):
            return self._applied.get_variable_layout(variable)
        return provisional_layout(variable.shape, self.device_mesh)

    def get_tensor_layout(self, path: str) -> TensorLayout | None:
        if self._applied is None:
            self._plan_in_traced_call()
        return None if self._applied is None else self._applied.get_tensor_layout(path)

    def _plan_in_traced_call(self) -> None:
        """Two trainer calls trace the model before asking for a data layout:
        `predict_on_batch` hands Keras's step its batch undistributed, and on
        keras 3.16 `fit` and `evaluate` build the loss, metrics and optimizer
        symbolically from the raw first batch before their first step (whose
        state is then already taken). The first layer output Keras lays out
        in them plans the model instead. The plan and the moves run eagerly,
        outside that trace; a step being traced keeps the old layout, and the
        step function is remade for the next call."""
        call = trainer_call_asking()
        if call is None or call.batch is None:
            return
        model = call.model
        if not all(layer.built for layer in keras_private.all_layers(model)):
            return  # still building: plan on a later call
        with jax.ensure_compile_time_eval(), keras_globals.outside_keras_call():
            self._plan_on_first_batch(model, call.batch)
            self._remake_stale_step_functions(model)


def multi_process() -> bool:
    """Whether this job runs on several processes (JAX's count)."""
    from keras_autoshard.runtime.jax_processes import process_count

    return process_count() > 1


def provisional_layout(shape, device_mesh) -> TensorLayout:
    """Cut the largest dimension the largest mesh axis divides (else replicate)."""
    sizes = dict(zip(device_mesh.axis_names, device_mesh.shape))
    axis = max(sizes, key=sizes.get)
    spec = [None] * len(shape)
    candidates = [
        (int(size), -dim)
        for dim, size in enumerate(shape)
        if size is not None and int(size) % sizes[axis] == 0 and int(size) > 1
    ]
    if candidates and sizes[axis] > 1:
        spec[-max(candidates)[1]] = axis
    return TensorLayout(spec, device_mesh)


def relayout_model(model: keras.Model, distribution: PlanDistribution) -> None:
    """Move every model and optimizer variable onto the plan's layouts.

    Each array goes from its current sharding to the planned one device to
    device (`jax.device_put` between shardings); no full copy is assembled.
    Optimizer slots follow their parameter; other optimizer and metric
    variables are replicated.
    """
    mesh = distribution.device_mesh
    by_slot_prefix = {}
    keys = variable_keys(model.variables)
    for variable in unique_variables(model.variables):
        entry = distribution.plan.variable(keys[id(variable)])
        layout = tensor_layout(entry.spec, mesh)
        move_variable(variable, layout)
        by_slot_prefix[slot_prefix(variable.path)] = (variable, layout)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        for slot in optimizer.variables:
            reference = slot_owner(slot, by_slot_prefix)
            if reference is None:
                move_variable(slot, TensorLayout([None] * len(slot.shape), mesh))
            else:
                move_variable(slot, reference[1])
    for variable in getattr(model, "metrics_variables", []):
        move_variable(variable, TensorLayout([None] * len(variable.shape), mesh))


def move_variable(variable, layout: TensorLayout) -> None:
    """Lay `variable` out by `layout`, moving its value device to device."""
    keras_variables.relayout(variable, layout)


def _as_mesh_spec(device_mesh) -> MeshSpec | None:
    if device_mesh is None:
        return None
    if isinstance(device_mesh, MeshSpec):
        return device_mesh
    return MeshSpec(tuple(device_mesh.shape), tuple(device_mesh.axis_names))


def symbolic_inputs(x):
    """`KerasTensor`s of the shapes and dtypes of `x` (a nest of arrays)."""
    return keras.tree.map_structure(
        lambda a: keras.KerasTensor(a.shape, keras.backend.standardize_dtype(a.dtype)),
        x,
    )
