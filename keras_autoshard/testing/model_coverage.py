"""Model coverage checks: a KerasHub backbone planned on a mesh, against one
device.

Each backbone of `hub_backbones` is built once on one device and its
forward pass compiled there (the reference, `build_backbone`). For a mesh,
an `AutoShardDistribution` plans it on the test batch (`prepare`: plan,
then move every variable onto its planned layout device to device), the
same forward pass is compiled under the distribution's scope and its
outputs compared with the reference (`check_on_mesh`); a train step can be
compared the same way (`train_step_parity`). `tests/test_model_coverage.py`
and `benchmarks/model_coverage.py` run these checks.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_autoshard import AutoShardDistribution, plan
from keras_autoshard.building import names_replayed_after
from keras_autoshard.compat import keras_variables
from keras_autoshard.plans.mesh import DATA_AXIS, MODEL_AXIS, SpecEntry
from keras_autoshard.plans.sharding_plan import MeshSpec
from keras_autoshard.testing.hub_backbones import CASES, HubBackboneCase, build
from keras_autoshard.testing.parity import relative_error

MESHES = {
    "2x4": MeshSpec((2, 4), (DATA_AXIS, MODEL_AXIS)),
    "1x8": MeshSpec((1, 8), (DATA_AXIS, MODEL_AXIS)),
    "8x1": MeshSpec((8, 1), (DATA_AXIS, MODEL_AXIS)),
}
BATCH_SIZE = 8
SEED = 1234


@dataclasses.dataclass
class BuiltBackbone:
    """One backbone built on one device, with its reference outputs.

    Attributes:
        case: The configuration it was built from.
        model: The model; its variables move onto each mesh in turn.
        inputs: The test batch (numpy).
        weights: Every variable's initial value (numpy), in `model.variables`
            order, to put back after a sharded run.
        build_seconds: Wall time of the build (and of the reference forward
            pass where `build_backbone` ran it).
        reference: The forward outputs on one device (numpy leaves), once
            computed: by `build_backbone(reference=True)`, by the first
            `reference_outputs()`, or by a reference training step (whose
            program computes the same forward pass).
        reference_step: The one-device training step's result and its
            regression targets, once a training check ran it (numpy).
    """

    case: HubBackboneCase
    model: keras.Model
    inputs: Any
    weights: list[np.ndarray]
    build_seconds: float
    reference: list[np.ndarray] | None = None
    reference_step: tuple[StepResult, list[np.ndarray]] | None = None

    def reference_outputs(self) -> list[np.ndarray]:
        """The forward outputs on one device (numpy leaves)."""
        if self.reference is None:
            self.reference = forward_on_one_device(self, self.inputs)
        return self.reference


@dataclasses.dataclass
class CoverageRow:
    """What one backbone class does on one mesh.

    Attributes:
        class_name: The `keras_hub.models` class.
        modality: "text", "vision", "audio" or "multimodal".
        mesh: The mesh, e.g. "2x4" (data x model).
        status: "ok", or the error that stopped it.
        plan_seconds: Wall time of `prepare` (trace, search, moves).
        parameter_bytes: Bytes of all variables.
        sharded_share: Share of those bytes in variables cut over some axis.
        per_device_over_ideal: Parameter bytes on the fullest device ÷
            (parameter bytes ÷ devices), from the addressable shards.
        batch_axis: The mesh axis (or tuple of axes) the batch is split
            over, or None.
        batch_note: Why the batch is kept whole ("" when split).
        parity: Largest relative error over the forward outputs.
        train: The training step's parity, where the check ran one
            (`check_on_mesh(..., train=True)`).
    """

    class_name: str
    modality: str
    mesh: str
    status: str
    plan_seconds: float = 0.0
    parameter_bytes: int = 0
    sharded_share: float = 0.0
    per_device_over_ideal: float = 0.0
    batch_axis: SpecEntry = None
    batch_note: str = ""
    parity: float = float("nan")
    train: TrainStepParity | None = None


def _forward(model: keras.Model):
    """A jitted `(trainable, non_trainable, inputs) -> output leaves`."""

    def forward(trainable, non_trainable, inputs):
        outputs, _ = model.stateless_call(trainable, non_trainable, inputs)
        return jax.tree_util.tree_leaves(outputs)

    return jax.jit(forward)


def _values(model: keras.Model):
    return (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
    )


def build_backbone(
    case: HubBackboneCase, batch_size: int = BATCH_SIZE, reference: bool = True
) -> BuiltBackbone:
    """Build `case` on one device.

    Args:
        case: The configuration.
        batch_size: Rows of the test batch.
        reference: Also compute the reference forward outputs now (so that a
            model whose forward pass fails on one device fails here);
            otherwise the first check that needs them computes them.

    Returns:
        The `BuiltBackbone`.
    """
    start = time.perf_counter()
    keras.utils.set_random_seed(SEED)
    # The initial values come from JAX's non-partitionable threefry: this
    # model is built on one device, and XLA:CPU compiles each initializer
    # (one per new weight shape) about 4 times faster that way (12 conv
    # kernels: 20.3 against 5.0 CPU-s); every check copies these values to
    # the sharded side, so which random numbers they are does not matter.
    with names_replayed_after(), jax.threefry_partitionable(False):
        model = build(case)
    built = BuiltBackbone(
        case=case,
        model=model,
        inputs=case.make_inputs(batch_size),
        weights=[np.asarray(v.value) for v in model.variables],
        build_seconds=0.0,
    )
    if reference:
        built.reference_outputs()
    built.build_seconds = time.perf_counter() - start
    return built


def forward_on_one_device(built: BuiltBackbone, inputs) -> list[np.ndarray]:
    """The model's forward output leaves for `inputs`, on one device."""
    outputs = _forward(built.model)(*_values(built.model), inputs)
    return [np.asarray(o) for o in outputs]


def _device_bytes(model: keras.Model) -> dict:
    """Bytes of the model's variables held on each device."""
    per_device: dict = {}
    seen = set()
    for variable in model.variables:
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        for shard in variable.value.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + (
                shard.data.nbytes
            )
    return per_device


def check_on_mesh(
    built: BuiltBackbone, mesh_name: str, train: bool = False
) -> CoverageRow:
    """Plan `built.model` on a mesh, run it sharded and compare with one device.

    Errors from planning or running are caught into the row's `status`; the
    batch-kept-whole warning is recorded in `batch_note`, not shown.

    Args:
        built: The backbone, its variables on one device.
        mesh_name: A key of `MESHES`.
        train: Run one training step (`TrainStepParity`) instead of the
            forward pass alone: one program computes the outputs (compared as
            the forward pass's), the loss, the gradients and the updated
            weights, sharded and on one device, under one plan.

    Returns:
        The `CoverageRow`, with `train` set where `train` is.
    """
    mesh = MESHES[mesh_name]
    row = CoverageRow(built.case.class_name, built.case.modality, mesh_name, "ok")
    model = built.model
    distribution = AutoShardDistribution(device_mesh=mesh)
    try:
        if train:
            reference, targets = one_device_step(built)
            if built.reference is None:
                built.reference = reference.outputs
        # Before `prepare` moves the variables off the one device.
        reference_outputs = built.reference_outputs()
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = distribution.prepare(model, built.inputs)
        row.plan_seconds = time.perf_counter() - start
        _record_plan(row, plan, model)
        with distribution.scope():
            inputs = _distributed(distribution, built.inputs)
            if train:
                step = _train_step(model)(*_values(model), inputs, targets)
                row.train = train_step_parity(step, reference, model)
                outputs = step.outputs
            else:
                outputs = _forward(model)(*_values(model), inputs)
        row.parity = _outputs_parity(outputs, reference_outputs)
    except Exception as error:  # noqa: BLE001 - the row records any failure
        row.status = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    finally:
        restore_weights(built)
    return row


def _record_plan(row: CoverageRow, plan, model: keras.Model) -> None:
    """The plan's batch axis and note, and its parameter bytes, into `row`."""
    row.batch_axis = plan.batch_axis
    row.batch_note = " ".join(
        n
        for n in plan.notes
        if n.startswith("The batch") or "kept whole on every device" in n
    )
    total = sum(v.total_bytes for v in plan.variables)
    cut = sum(v.total_bytes for v in plan.variables if any(v.spec))
    row.parameter_bytes = total
    row.sharded_share = cut / total if total else 0.0
    fullest = max(_device_bytes(model).values(), default=0)
    row.per_device_over_ideal = (
        fullest * plan.mesh.device_count / total if total else 1.0
    )


def _outputs_parity(outputs, reference_outputs) -> float:
    """Largest relative error of the sharded output leaves."""
    if len(outputs) != len(reference_outputs):
        raise AssertionError(
            f"{len(outputs)} outputs sharded, {len(reference_outputs)} on one device"
        )
    return max(
        (relative_error(out, ref) for out, ref in zip(outputs, reference_outputs)),
        default=0.0,
    )


@dataclasses.dataclass
class TrainStepParity:
    """One SGD step of a mean-square loss on the outputs, sharded vs one device.

    Attributes:
        loss: Relative error of the loss.
        gradients: Largest relative error of any gradient, each judged against
            at least 1e-3 of the largest gradient (a gradient that is
            analytically zero is rounding noise on both sides).
        weights: Largest relative error of any updated weight, judged against
            the largest weight.
        worst_gradient: Path of the variable with the largest gradient error.
    """

    loss: float
    gradients: float
    weights: float
    worst_gradient: str


class StepResult(NamedTuple):
    """What `_train_step`'s program returns."""

    loss: Any
    gradients: list
    updated: list
    outputs: list


def _train_step(model: keras.Model, learning_rate: float = 0.1):
    """A jitted `(trainable, non_trainable, inputs, targets) -> StepResult`:
    the mean squared error of every float output against its target, its
    gradients, one SGD step, and the forward output leaves."""

    def loss_fn(trainable, non_trainable, inputs, targets):
        outputs, _ = model.stateless_call(trainable, non_trainable, inputs)
        floats = _float_leaves(outputs)
        loss = sum(jnp.mean(jnp.square(o - t)) for o, t in zip(floats, targets))
        return loss, jax.tree_util.tree_leaves(outputs)

    def step(trainable, non_trainable, inputs, targets):
        (loss, outputs), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, non_trainable, inputs, targets
        )
        updated = [w - learning_rate * g for w, g in zip(trainable, grads)]
        return StepResult(loss, grads, updated, outputs)

    return jax.jit(step)


def _float_leaves(outputs) -> list:
    leaves = jax.tree_util.tree_leaves(outputs)
    return [o for o in leaves if jnp.issubdtype(o.dtype, jnp.floating)]


def regression_targets(built: BuiltBackbone) -> list[np.ndarray]:
    """Random targets, one per float output. (Not the outputs' mean square:
    most backbones end in a layer norm, whose output's mean square is
    constant, so that loss would leave every earlier gradient zero up to
    rounding.) The outputs' shapes come from tracing the forward pass."""
    rng = np.random.default_rng(SEED)
    shapes = jax.eval_shape(_forward(built.model), *_values(built.model), built.inputs)
    return [rng.standard_normal(o.shape).astype(o.dtype) for o in _float_leaves(shapes)]


def one_device_step(built: BuiltBackbone) -> tuple[StepResult, list[np.ndarray]]:
    """The one-device training step on regression targets, and the targets
    (computed once per backbone, kept on `built`)."""
    if built.reference_step is None:
        model = built.model
        targets = regression_targets(built)
        step = _train_step(model)(*_values(model), built.inputs, targets)
        built.reference_step = (jax.tree_util.tree_map(np.asarray, step), targets)
    return built.reference_step


def train_step_parity(
    sharded: StepResult, reference: StepResult, model: keras.Model
) -> TrainStepParity:
    """How far a sharded training step is from the one-device step."""
    ref_grads, ref_updated = reference.gradients, reference.updated
    floor = 1e-3 * max((float(np.max(np.abs(g))) for g in ref_grads), default=0.0)
    grad_errors = [
        relative_error(g, r, scale_floor=floor)
        for g, r in zip(sharded.gradients, ref_grads)
    ]
    weight_scale = max((float(np.max(np.abs(w))) for w in ref_updated), default=0.0)
    worst = int(np.argmax(grad_errors)) if grad_errors else 0
    return TrainStepParity(
        loss=relative_error(sharded.loss, reference.loss),
        gradients=max(grad_errors, default=0.0),
        weights=max(
            (
                relative_error(w, r, scale_floor=weight_scale)
                for w, r in zip(sharded.updated, ref_updated)
            ),
            default=0.0,
        ),
        worst_gradient=model.trainable_variables[worst].path if grad_errors else "",
    )


def train_step_sensitivity(built: BuiltBackbone, nudge: float = 1e-7) -> float:
    """How far (relative, as `TrainStepParity.gradients` judges it) the
    one-device gradients move when every weight moves by `nudge` (relative),
    each by ± at random (seeded): the rounding-level change a model's
    training step amplifies. A sharded step differs from one device by
    reduction order only, so a model whose gradients move more than the
    tolerance under this nudge is ill-conditioned, not wrongly sharded.
    (Scaling every weight by the same factor would mostly cancel in the
    normalisation layers.)"""
    model = built.model
    unmoved, targets = one_device_step(built)
    trainable, non_trainable = _values(model)
    rng = np.random.default_rng(SEED)
    nudged = [
        np.asarray(w)
        * (1 + nudge * rng.choice([-1.0, 1.0], size=w.shape)).astype(w.dtype)
        for w in trainable
    ]
    moved = _train_step(model)(nudged, non_trainable, built.inputs, targets).gradients
    reference = unmoved.gradients
    floor = 1e-3 * max((float(np.max(np.abs(g))) for g in reference), default=0.0)
    return max(
        (relative_error(g, r, scale_floor=floor) for g, r in zip(moved, reference)),
        default=0.0,
    )


def _distributed(distribution, inputs):
    """`inputs` put on the devices with the distribution's data layouts."""
    return jax.tree_util.tree_map(
        lambda a: jax.device_put(
            a, distribution.get_data_layout(a.shape).backend_layout
        ),
        inputs,
    )


def restore_weights(built: BuiltBackbone) -> None:
    """Put the initial weights back on one device (undo a plan's moves)."""
    device = jax.devices()[0]
    for variable, value in zip(built.model.variables, built.weights):
        keras_variables.reset_placement(variable, jax.device_put(value, device))


def run(
    class_names: Sequence[str], mesh_names: Sequence[str], log=print
) -> list[CoverageRow]:
    """Coverage rows for every class on every mesh."""
    rows = []
    for class_name in class_names:
        case = CASES[class_name]
        try:
            built = build_backbone(case)
        except Exception as error:  # noqa: BLE001
            status = f"fails: {_planning_error(case, error)}"
            rows += [
                CoverageRow(class_name, case.modality, mesh, status)
                for mesh in mesh_names
            ]
            continue
        for mesh_name in mesh_names:
            row = check_on_mesh(built, mesh_name)
            log(
                f"{class_name:32s} {mesh_name} {row.status[:60]:20s} "
                f"plan {row.plan_seconds:5.1f}s parity {row.parity:.2g} "
                f"batch {row.batch_axis}"
            )
            rows.append(row)
        jax.clear_caches()
    return rows


def _planning_error(case: HubBackboneCase, error: Exception) -> str:
    """What planning says of a case whose one-device forward pass failed with
    `error` (the library's error names the layer; JAX's may not)."""
    try:
        model = build(case)
        plan(model, MESHES["2x4"], sample_input=case.make_inputs(BATCH_SIZE))
    except Exception as planning_error:  # noqa: BLE001
        error = planning_error
    return f"{type(error).__name__}: {str(error).split('. ')[0][:300]}"
