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
from keras_autoshard.planner.cost_model import (
    Assignment,
    PlanCost,
    PlannerOptions,
    planning_axes,
    tensor_axes,
)
from keras_autoshard.planner.explain import plan_notes, variable_reason
from keras_autoshard.planner.levers import (
    Candidate,
    NoFit,
    choose_levers,
    sequence_parallel_modes,
)
from keras_autoshard.planner.linear_program import InfeasibleError
from keras_autoshard.planner.memory_model import JOBS, batch_axis
from keras_autoshard.planner.notes import memory_note, no_fit_message, uneven_state_note
from keras_autoshard.planner.output_layouts import output_layouts
from keras_autoshard.planner.pins import Pins
from keras_autoshard.planner.roles import class_roles
from keras_autoshard.planner.sequence_parallel import SequenceCut
from keras_autoshard.plans.hardware import HardwareProfile, hardware_profile
from keras_autoshard.plans.mesh import DEFAULT_AXIS_NAMES, entry_axes, spec_axes
from keras_autoshard.plans.rules import Spec, match_rules
from keras_autoshard.plans.sharding_plan import (
    MeshSpec,
    PlanError,
    ShardingPlan,
    VariableSharding,
)
from keras_autoshard.plans.units import optional_byte_size
from keras_autoshard.plans.validation import validate_plan_structure
from keras_autoshard.progress import progress_bar
from keras_autoshard.runtime.devices import accelerator_memory_budget

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
    return plan_with_cost(
        model_or_builder,
        device_mesh=device_mesh,
        sample_input=sample_input,
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
    ).plan


def plan_with_cost(
    model_or_builder,
    device_mesh=None,
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
) -> PlanningResult:
    """Like `plan`, also returning the estimated cost and the axis graph."""
    if job not in JOBS:
        raise ValueError(f"job={job!r}: use one of {JOBS}.")
    sequence_parallel_modes(sequence_parallel, job)  # checks the request
    if gradient_accumulation_steps is not None and gradient_accumulation_steps < 1:
        raise PlanError(
            f"gradient_accumulation_steps={gradient_accumulation_steps}: use None "
            "(chosen to fit), 1 (never) or a count of micro-batches."
        )
    profile = hardware_profile(hardware) if hardware is not None else None
    memory_budget = optional_byte_size(memory_budget)
    budget_asked = memory_budget is not None
    if memory_budget is None:
        memory_budget = (
            profile.memory_budget_bytes
            if profile is not None
            else accelerator_memory_budget()
        )
    from keras_autoshard.graph.builder import build_axis_graph
    from keras_autoshard.trace.tracer import build_abstract, trace_model

    start = time.perf_counter()
    if sample_input is None:
        raise PlanError(
            "plan() needs sample_input (one global batch, or jax.ShapeDtypeStruct "
            "leaves with its shapes) to know the activation shapes."
        )
    meshes = _candidate_meshes(device_mesh, device_count)
    with progress_bar("planning", 3 + len(meshes), enabled=progress) as task:
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
        options = PlannerOptions(
            memory_budget_bytes=memory_budget,
            optimizer_slots=optimizer_slots,
            platform=platform,
            hardware=profile,
            job=job,
            rematerialize=_remat_request(rematerialize),
            sequence_parallel=sequence_parallel,
            gradient_accumulation_steps=gradient_accumulation_steps,
            batch_over_model_axes=batch_over_model_axes,
        )
        best = None
        reasons = []
        no_fit: list[tuple[MeshSpec, NoFit]] = []
        for mesh in meshes:
            task.describe(f"planning: search on {mesh.describe()}")
            try:
                candidate = _plan_on_mesh(graph, traced.variables, mesh, options, rules)
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
        if budget_asked:
            raise PlanError(message)
        warnings.warn(message, stacklevel=2)
        best = _finish_plan(graph, traced.variables, mesh, rules, closest.best)
        best = (
            dataclasses.replace(best[0], notes=best[0].notes + (message,)),
            best[1],
        )
    if best is None:
        if memory_budget is None:
            raise PlanError(
                "No plan satisfies the rules and divisibility on "
                f"{', '.join(m.describe() for m in meshes)} (there is no memory "
                f"budget). {' '.join(reasons)} Check that each rule's spec can "
                "hold: its mesh axes divide the dimensions they cut, no mesh axis "
                "twice in one tensor, and tensors that must share a sharding "
                "(e.g. a kernel and the activation it makes) are not pinned to "
                f"conflicting axes. Rules given: {sorted(rules or {})}."
            )
        raise PlanError(
            f"No plan on {', '.join(m.describe() for m in meshes)}: {' '.join(reasons)}"
        )
    sharding_plan, cost = best
    if traced.notes:
        sharding_plan = dataclasses.replace(
            sharding_plan, notes=traced.notes + sharding_plan.notes
        )
    return PlanningResult(sharding_plan, cost, graph, time.perf_counter() - start)


def _remat_request(rematerialize: str | Sequence[str]) -> str | tuple[str, ...]:
    return rematerialize if isinstance(rematerialize, str) else tuple(rematerialize)


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


def _plan_on_mesh(graph, variables, mesh: MeshSpec, options, rules):
    axes = planning_axes(mesh)
    pinned_specs = _pinned_specs(variables, rules)
    _check_rules_against_shapes(variables, rules, mesh)
    pins = _pins_from_specs(graph, pinned_specs, mesh)
    chosen = choose_levers(graph, axes, mesh, options, pins)
    return _finish_plan(graph, variables, mesh, rules, chosen)


def _finish_plan(graph, variables, mesh, rules, chosen: Candidate):
    pinned_specs = _pinned_specs(variables, rules)
    sharding_plan = _build_plan(
        graph,
        variables,
        mesh,
        chosen.assignment,
        chosen.cost,
        pinned_specs,
        chosen.estimate,
        chosen.remat,
        chosen.sequence,
    )
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


def _pinned_specs(variables, rules) -> dict[str, tuple]:
    if not rules:
        return {}
    matched = match_rules([v.path for v in variables], rules)
    return {path: spec for path, (_, spec) in matched.items()}


def _check_rules_against_shapes(variables, rules, mesh: MeshSpec) -> None:
    """Every rule's spec fits its variables on `mesh`, before any search: the
    error names the rule, variable, dim, size and mesh axis."""
    if not rules:
        return
    shapes = {v.path: tuple(v.shape) for v in variables}
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    matched = match_rules(list(shapes), rules)
    for path, (rule, spec) in sorted(matched.items()):
        shape = shapes[path]
        where = f"Rule {rule!r} (spec {tuple(spec)}) on variable {path!r} {shape}"
        if len(spec) != len(shape):
            raise PlanError(
                f"{where}: the spec has {len(spec)} entries, the variable "
                f"{len(shape)} dims. Give one mesh axis or None per dim."
            )
        named = spec_axes(spec)
        for axis in named:
            if axis not in sizes:
                raise PlanError(
                    f"{where}: mesh axis {axis!r} is not in the mesh {mesh.describe()}."
                )
        if len(set(named)) != len(named):
            raise PlanError(f"{where}: a mesh axis may cut only one dim of a tensor.")
        for dim, entry in enumerate(spec):
            size = mesh.axis_size(entry_axes(entry))
            if shape[dim] % size:
                axes = " x ".join(f"{a!r}" for a in entry_axes(entry))
                raise PlanError(
                    f"{where}: dim {dim} has size {shape[dim]}, which mesh axis "
                    f"{axes} (size {size}) does not divide. Cut another "
                    "dim, use a mesh axis that divides it, or pad the layer to "
                    f"a multiple of {size}."
                )


def _pins_from_specs(graph: AxisGraph, pinned: Mapping[str, tuple], mesh) -> Pins:
    class_axis: dict[int, str | None] = {}
    fsdp: dict[str, list[tuple[int, str]]] = {}
    for path, spec in pinned.items():
        tensor = graph.params_by_path.get(path)
        if tensor is None:
            continue
        if len(spec) != len(tensor.shape):
            raise PlanError(
                f"Rule for {path!r} gives spec {spec} with {len(spec)} entries; "
                f"the variable has shape {tensor.shape}."
            )
        for dim, axis in enumerate(spec):
            if isinstance(axis, tuple):
                raise PlanError(
                    f"Rule for {path!r} cuts dim {dim} over several mesh axes "
                    f"{axis}; the planner takes one mesh axis per dim in rules "
                    "so far. Give the whole plan by rules instead "
                    "(keras_autoshard.plans.rules.plan_from_rules), or one axis."
                )
            cls = tensor.dim_classes[dim]
            if cls is None:
                if axis is not None:
                    raise PlanError(
                        f"Rule shards dim {dim} of {path!r} (size 1) on {axis!r}."
                    )
                continue
            shardable = graph.classes[cls].unshardable_reason is None
            if axis is None or not shardable:
                if axis is not None:
                    fsdp.setdefault(path, []).append((dim, axis))
                elif cls not in class_axis:
                    class_axis[cls] = None
                continue
            previous = class_axis.get(cls, axis)
            if previous != axis:
                raise PlanError(
                    f"Rules disagree: {path!r} dim {dim} on {axis!r}, but another "
                    f"rule puts the same tensor axis on {previous!r} (they must "
                    "match, the computation couples them)."
                )
            class_axis[cls] = axis
    return Pins(
        class_axis=class_axis,
        fsdp={k: tuple(v) for k, v in fsdp.items()},
        no_fsdp=frozenset(pinned),
    )


def _build_plan(
    graph,
    variables,
    mesh,
    assignment: Assignment,
    cost,
    pinned,
    estimate=None,
    remat: tuple[str, ...] = (),
    sequence: SequenceCut | None = None,
):
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
            spec, reason = tuple(pinned[info.path]), "user rule"
        elif tensor is None or not info.dtype.startswith(("float", "bfloat")):
            spec = (None,) * len(info.shape)
            reason = "replicated: not a floating-point tensor of the computation"
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
        graph, assignment, pinned, sequence, estimate.job if estimate else "train"
    )
    if estimate is not None:
        pin_notes.append(memory_note(estimate))
    plan = ShardingPlan(
        mesh=mesh,
        variables=tuple(entries),
        batch_axis=data_axis,
        activations=activations,
        notes=tuple(plan_notes(graph, mesh, assignment, roles, cost) + pin_notes),
        estimate=estimate,
        rematerialize=remat,
    )
    validate_plan_structure(plan)
    return plan
