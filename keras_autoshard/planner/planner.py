"""`plan()`: from a Keras model and a mesh to a `ShardingPlan`.

model → abstract trace → axis graph → exact search → plan. No model-specific
code and no layer-name patterns: the plan follows from the graph and the cost
model alone (user rules may pin parts of it).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

import keras

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.planner.cost_model import PlanCost, tensor_axes
from keras_autoshard.planner.explain import (
    NOT_COMPUTED_REASON,
    USER_RULE_REASON,
    plan_notes,
    variable_reason,
)
from keras_autoshard.planner.levers import Candidate, NoFit, choose_levers
from keras_autoshard.planner.linear_program import InfeasibleError
from keras_autoshard.planner.memory_model import batch_axis
from keras_autoshard.planner.mesh_axis import planning_axes
from keras_autoshard.planner.notes import (
    memory_note,
    no_fit_message,
    no_plan_message,
    uneven_state_note,
)
from keras_autoshard.planner.output_layouts import output_layouts
from keras_autoshard.planner.pins import match_variables, pinned_specs, pins_on_mesh
from keras_autoshard.planner.plan_request import PlanRequest
from keras_autoshard.planner.roles import class_roles
from keras_autoshard.plans.hardware import HardwareProfile
from keras_autoshard.plans.mesh import DEFAULT_AXIS_NAMES
from keras_autoshard.plans.rules import Spec
from keras_autoshard.plans.sharding_plan import (
    MeshSpec,
    PlanError,
    ShardingPlan,
    VariableSharding,
)
from keras_autoshard.plans.validation import validate_plan_structure
from keras_autoshard.progress import progress_bar

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PlanningResult:
    """A plan with the evidence behind it."""

    plan: ShardingPlan
    cost: PlanCost
    graph: AxisGraph
    planning_time_s: float


def plan(
    model_or_builder: keras.Model | Callable[[], keras.Model],
    device_mesh: MeshSpec | keras.distribution.DeviceMesh | None = None,
    sample_input=None,
    memory_budget: int | str | None = None,
    rules: Mapping[str, Spec] | None = None,
    device_count: int | None = None,
    optimizer_slots: int = 2,
    progress: bool = False,
    hardware: str | HardwareProfile | None = None,
    job: str = "train",
    rematerialize: str | Sequence[str] = "auto",
    sequence_parallel: bool | str = False,
    gradient_accumulation_steps: int | None = None,
    batch_over_model_axes: bool = True,
) -> ShardingPlan:
    """Find a sharding plan for a model on a mesh, automatically.

    Args:
        model_or_builder: A built `keras.Model`, or a function with no
            arguments that builds one (it is then built abstractly: no weight
            is allocated, and the next real build gets the same paths).
        device_mesh: A `MeshSpec` or `keras.distribution.DeviceMesh`; when
            `None`, every (data, model) factorisation of `device_count` (all
            devices by default) is planned and the cheapest is kept.
        sample_input: One batch of inputs (arrays, a dict of arrays, or
            `jax.ShapeDtypeStruct`s with the global batch size).
        memory_budget: Per-device bytes (a number, or a string such as
            `"16GiB"`). The search keeps the whole peak of a step within
            it (parameters, gradients, optimizer state, kept activations,
            data, transient buffers; `plan.estimate`), choosing
            rematerialization where the sharding alone does not fit; when
            nothing fits, a `PlanError` says by how much and what would.
            `None`: the hardware profile's usable memory, else the
            accelerators' own (`memory_stats()`, less a 5 % reserve), else
            (simulated CPU devices) no limit; a plan that cannot fit such a
            default budget is returned with a warning and a note instead.
        rules: Regular expression on variable path → spec, pinned as given;
            the planner fills in the rest. A rule matching nothing is an error.
        device_count: Devices to plan for when `device_mesh` is `None`.
        optimizer_slots: Optimizer state per parameter in parameter copies.
        progress: Show a progress bar on stderr (trace, axis graph, one
            search per candidate mesh); worth it for large models.
        hardware: A hardware profile (`"h100-80gb"`, `"a100-40gb"`,
            `"a100-80gb"`, `"tpu-v5e"`, `"tpu-v5p"`, or a `HardwareProfile`):
            the default budget, and the step time in the estimate (the
            objective among plans that fit).
        job: `"train"` (a training step: gradients, optimizer state and
            kept activations), `"inference"` (`predict`: variables, data
            and the largest activations) or `"generate"` (inference plus
            the key/value cache of every attention at the sample's
            sequence length).
        rematerialize: `"auto"`: layers are rematerialized only where the
            budget needs it (the fewest that fit); `"none"`: never; `"all"`:
            every repeated-layer family (the transformer layers of a
            backbone, or of the backbone a task or wrapper calls, named by
            path: `gpt2_backbone/transformer_layer_0`), e.g. to fit a larger
            batch; or a list of such layer names. The plan's
            `rematerialize` lists the layers, which
            `AutoShardDistribution` (or `keras_autoshard.rematerialize`)
            checkpoints.
        sequence_parallel: Cut the token dim of the activations between
            tensor-parallel regions (norms, dropouts, the residual stream
            of repeated layers) over the tensor-parallel axis, Megatron-SP:
            each region's all-reduce becomes a reduce-scatter and an
            all-gather (the same bytes on the wire) and those activations
            shrink by the axis size. The plan pins the layer outputs it
            needs (`plan.activations`); its notes name the layers it leaves
            out and why (e.g. K/V projections not cut over the axis).
            `"auto"`: only where the plan does not fit the budget without
            it, tried before each rematerialization option (it recomputes
            nothing).
        gradient_accumulation_steps: `None`: micro-batches only when nothing
            else fits the budget (the fewest that fit); `1`: never; `n`:
            always `n` (each data-parallel rank's batch must divide by it),
            the sharding and other levers chosen for that micro-batch.
        batch_over_model_axes: On a mesh whose data axes cannot cut the
            batch (none of size > 1, as on 1x8), a model axis may: the plan
            first leaves the least compute repeated on the devices (data
            parallelism over `"model"` where tensor parallelism would
            repeat some, a small model's layers), then moves the fewest
            bytes, within the budget. `False` (and `sequence_parallel=True`,
            which needs the axis for the model): model axes cut only the
            model.

    Returns:
        A `ShardingPlan`; `plan.explain()` says why each variable is cut so.

    Example:

    ```python
    plan = keras_autoshard.plan(
        lambda: keras_hub.models.GPT2Backbone(**config),
        MeshSpec((2, 4), ("batch", "model")),
        sample_input={"token_ids": ids, "padding_mask": mask},
    )
    print(plan.explain())
    ```
    """
    request = PlanRequest(
        memory_budget=memory_budget,
        rules=rules,
        device_count=device_count,
        optimizer_slots=optimizer_slots,
        progress=progress,
        hardware=hardware,
        job=job,
        rematerialize=rematerialize,
        sequence_parallel=sequence_parallel,
        gradient_accumulation_steps=gradient_accumulation_steps,
        batch_over_model_axes=batch_over_model_axes,
    )
    return plan_with_cost(model_or_builder, device_mesh, sample_input, request).plan


def plan_with_cost(
    model_or_builder: keras.Model | Callable[[], keras.Model],
    device_mesh: MeshSpec | keras.distribution.DeviceMesh | None = None,
    sample_input=None,
    request: PlanRequest | None = None,
) -> PlanningResult:
    """Like `plan`, also returning the estimated cost and the axis graph.

    Args:
        model_or_builder: As `plan`'s.
        device_mesh: As `plan`'s.
        sample_input: As `plan`'s.
        request: `plan`'s other keyword arguments (`None`: its defaults).

    Returns:
        The plan, its cost, the axis graph and the planning time.
    """
    request = request or PlanRequest()
    request.check()
    profile = request.profile()
    memory_budget = request.budget_bytes(profile)
    from keras_autoshard.graph.builder import build_axis_graph
    from keras_autoshard.trace.tracer import build_abstract, trace_model

    start = time.perf_counter()
    if sample_input is None:
        raise PlanError(
            "plan() needs sample_input (one global batch, or jax.ShapeDtypeStruct "
            "leaves with its shapes) to know the activation shapes."
        )
    meshes = _candidate_meshes(device_mesh, request.device_count)
    with progress_bar("planning", 3 + len(meshes), enabled=request.progress) as task:
        if isinstance(model_or_builder, keras.Model):
            model = model_or_builder
        elif callable(model_or_builder):
            task.describe("planning: building the model abstractly")
            model = build_abstract(model_or_builder)
        else:
            raise TypeError(
                "plan() takes a keras.Model or a function that builds one, got "
                f"{type(model_or_builder).__name__}."
            )
        task.advance()
        task.describe("planning: tracing shapes")
        traced = trace_model(model, sample_input)
        task.advance()
        task.describe("planning: axis graph")
        graph = build_axis_graph(
            traced.closed_jaxpr, traced.invar_kinds, traced.inputs_made_in_step
        )
        task.advance()
        platform = profile.platform if profile is not None else _device_platform()
        graph = graph.for_platform(platform)
        options = request.planner_options(memory_budget, platform, profile)
        matches = match_variables(traced.variables, request.rules)
        pinned = pinned_specs(matches)
        best = None
        reasons = []
        no_fit: list[tuple[MeshSpec, NoFit]] = []
        for mesh in meshes:
            task.describe(f"planning: search on {mesh.describe()}")
            try:
                pins = pins_on_mesh(graph, matches, mesh)
                chosen = choose_levers(graph, planning_axes(mesh), mesh, options, pins)
                candidate = _finish_plan(graph, traced.variables, mesh, pinned, chosen)
            except NoFit as error:
                logger.info("Mesh %s: %s", mesh.describe(), error)
                no_fit.append((mesh, error))
                continue
            except InfeasibleError as error:
                logger.info("Mesh %s: %s", mesh.describe(), error)
                reasons.append(f"{mesh.describe()}: {error}")
                continue
            finally:
                task.advance()
            if best is None or _objective(candidate) < _objective(best):
                best = candidate
        task.describe("planning: done")
    if best is None and no_fit:
        mesh, closest = min(no_fit, key=lambda m: m[1].best.estimate.peak_bytes)
        message = no_fit_message(mesh, closest)
        if request.budget_asked:
            raise PlanError(message)
        warnings.warn(message, stacklevel=2)
        best = _finish_plan(graph, traced.variables, mesh, pinned, closest.best)
        best = (
            dataclasses.replace(best[0], notes=best[0].notes + (message,)),
            best[1],
        )
    if best is None:
        raise PlanError(no_plan_message(meshes, reasons, memory_budget, request.rules))
    sharding_plan, cost = best
    if traced.notes:
        sharding_plan = dataclasses.replace(
            sharding_plan, notes=traced.notes + sharding_plan.notes
        )
    return PlanningResult(sharding_plan, cost, graph, time.perf_counter() - start)


def _device_platform() -> str:
    """The platform of the devices Keras sees (`"cpu"` for simulated ones)."""
    import jax

    return jax.devices()[0].platform


def _objective(candidate: tuple[ShardingPlan, PlanCost]) -> float:
    """Step time under the profile when there is one, else bytes moved
    plus the replicated-math penalty."""
    plan, cost = candidate
    if plan.estimate is not None and plan.estimate.step_time_s is not None:
        return plan.estimate.step_time_s
    return cost.communication_bytes + cost.replicated_flops


def _candidate_meshes(device_mesh, device_count) -> list[MeshSpec]:
    if device_mesh is not None:
        if isinstance(device_mesh, MeshSpec):
            return [device_mesh]
        return [MeshSpec(tuple(device_mesh.shape), tuple(device_mesh.axis_names))]
    if device_count is None:
        device_count = len(keras.distribution.list_devices())
    return [
        MeshSpec((device_count // m, m), DEFAULT_AXIS_NAMES)
        for m in range(1, device_count + 1)
        if device_count % m == 0
    ]


def _finish_plan(
    graph: AxisGraph,
    variables,
    mesh: MeshSpec,
    pinned: Mapping[str, tuple],
    chosen: Candidate,
) -> tuple[ShardingPlan, PlanCost]:
    """The plan of `chosen` on `mesh`, pinned variables as the rules say."""
    sharding_plan = _build_plan(graph, variables, mesh, pinned, chosen)
    if chosen.micro_batches > 1:
        sharding_plan = dataclasses.replace(
            sharding_plan, gradient_accumulation_steps=chosen.micro_batches
        )
    note = uneven_state_note(sharding_plan)
    if note:
        sharding_plan = dataclasses.replace(
            sharding_plan, notes=sharding_plan.notes + (note,)
        )
    return sharding_plan, chosen.cost


def _build_plan(
    graph: AxisGraph,
    variables,
    mesh: MeshSpec,
    pinned: Mapping[str, tuple],
    chosen: Candidate,
) -> ShardingPlan:
    assignment, estimate = chosen.assignment, chosen.estimate
    roles = class_roles(graph)
    by_name = {t.name: t for t in graph.tensors if t.kind in ("param", "state")}
    unread = set(graph.unread)
    entries = []
    for info in variables:
        tensor = by_name.get(info.path)
        var_roles = tuple(
            None if tensor is None or c is None else roles.get(c)
            for c in (tensor.dim_classes if tensor else (None,) * len(info.shape))
        )
        if info.path in pinned:
            spec, reason = tuple(pinned[info.path]), USER_RULE_REASON
        elif tensor is None or not info.dtype.startswith(("float", "bfloat")):
            spec = (None,) * len(info.shape)
            reason = NOT_COMPUTED_REASON
        else:
            spec = tensor_axes(tensor, assignment)
            reason = variable_reason(
                tensor, spec, var_roles, assignment, tensor.id in unread
            )
        entries.append(
            VariableSharding(info.path, info.shape, info.dtype, spec, var_roles, reason)
        )
    data_axis = batch_axis(graph, assignment)
    activations, pin_notes = output_layouts(
        graph, assignment, pinned, chosen.sequence, estimate.job
    )
    pin_notes.append(memory_note(estimate, chosen.levers))
    plan = ShardingPlan(
        mesh=mesh,
        variables=tuple(entries),
        batch_axis=data_axis,
        activations=activations,
        notes=tuple(
            plan_notes(graph, mesh, assignment, roles, chosen.cost) + pin_notes
        ),
        estimate=estimate,
        rematerialize=chosen.remat,
    )
    validate_plan_structure(plan)
    return plan
