"""The memory budget as a constraint of the search: the whole peak.

`memory_model.estimate_memory` says what a device holds at the peak of a
step under a given sharding; this module writes the same sum as one linear
row of the search's program, so that the search only returns plans whose
peak fits:

- every variable's shard, and for trainable ones their gradient (unless
  no equation reads them) and optimizer slots (FSDP storage cuts included);
- the activations kept for the backward pass under the chosen
  rematerialization, each cut like its tensor, and the gathered copies of
  the FSDP-cut weights it keeps;
- the inputs (cut like them) and targets (cut by the data axes);
- for inference and generation on XLA:CPU, the weights it copies into
  another layout for their matrix products (`cost_model.relaid_weights`);
- the loss's buffers (twice the outputs) and one variable `T` at least as
  large as each candidate transient (three times each of the largest batch
  activations, once each of the largest weight-derived ones (their
  gradient; the weight itself is resident or a kept gathered copy), each
  backward workspace).

`T` is bounded by the largest activation of each set of axis classes (any
sharding shrinks tensors of one class set alike, so that one is the set's
largest on every device too).

The estimate takes the fullest of the step's phases (backward pass, loss,
a pooling's workspace); this row adds their parts, an envelope of them.
Under gradient accumulation a second row bounds the update (a new copy of
every trainable variable, its slots and, on XLA:CPU, its accumulator beside
the old, with the data; the backward pass's activations are freed by then). On
an accelerator, rows for the lowest stages of the backward pass bound the
gradients it holds to the end (`_lowest_stage_rows`).

With layers rematerialized, this row is the envelope of the backward
pass's stages (`remat.backward_stages`): every gradient counted beside the
largest layer's recomputed residuals, as a schedule that runs each update
last would hold them. The estimate reports the fullest stage, which is
lower; the row leaves that difference as margin (measured on XLA:CPU: a
schedule may also run weight-gradient matmuls late, keeping their
operands, `tests/planner/test_memory_estimate.py`).
"""

from __future__ import annotations

import math

import numpy as np

from keras_autoshard.planner.batch_classes import batch_carrying_classes
from keras_autoshard.planner.cost_model import (
    kept_widening,
    relaid_weights,
    widening,
)
from keras_autoshard.planner.gradient_reduction import (
    COMBINE_THRESHOLD_BYTES,
    gathered_weight_copies,
)
from keras_autoshard.planner.linear_program import InfeasibleError
from keras_autoshard.planner.milp_program import MilpProgram, Terms
from keras_autoshard.planner.remat import (
    accelerator_stages,
    gathered_param_terms,
    kept_terms,
)

# Cost per byte of peak when the search minimises the peak (no plan fits):
# well above any communication byte.
PEAK_WEIGHT = 1e3
MIB = 2.0**20


def add_peak_budget(
    program: MilpProgram, remat: frozenset[str], micro_batches: int = 1
) -> None:
    """Add the row `peak per device <= budget` to `program`.

    Args:
        program: The search's `MilpProgram` (its graph, options, mesh axes,
            linear program and `bytes_terms`).
        remat: Names of the layer calls rematerialized (`graph/blocks.py`).
        micro_batches: Gradient accumulation parts (what the batch makes
            shrinks by it; each trainable variable gains an accumulator).

    With no budget and `options.minimize_peak`, the peak becomes the
    first term of the objective instead (what the planner reports when no
    plan fits).

    Raises:
        InfeasibleError: When the parts no sharding can cut exceed the
            budget alone.
    """
    options = program.options
    budget = options.memory_budget_bytes
    if budget is None and not options.minimize_peak:
        return
    graph = program.graph
    half = options.platform == "cpu"
    accelerator = options.platform != "cpu"
    row: dict[int, float] = {}
    constant = 0.0
    # Under gradient accumulation, the update's row (`memory_model`: every
    # trainable variable, its slots and on XLA:CPU its accumulator written
    # anew beside the old; no loss or backward workspace, and on XLA:CPU no
    # gradient).
    update: dict[int, float] | None = {} if micro_batches > 1 else None
    update_constant = 0.0

    def add(tensor, fsdp: bool, scale: float, update_scale: float | None = None):
        nonlocal constant, update_constant
        fixed, terms = program.bytes_terms(tensor, fsdp=fsdp, scale=scale)
        constant += fixed
        for var, coefficient in terms.items():
            row[var] = row.get(var, 0.0) + coefficient
        if update is None:
            return
        if update_scale is None:
            update_scale = scale
        ratio = update_scale / scale if scale else 0.0
        update_constant += fixed * ratio
        for var, coefficient in terms.items():
            update[var] = update.get(var, 0.0) + coefficient * ratio

    train = options.job == "train"
    part = 1.0 / micro_batches
    slots = options.optimizer_slots
    accumulating = micro_batches > 1
    # One accelerator keeps the accumulating conditional and holds a copy
    # of the accumulators through the backward pass (`accelerator_peak`).
    one_device = accelerator and not program.axes
    copies = 2.0 + slots + accumulating + (one_device and accumulating)
    # The update: the variable, its slots and accumulator, and their new
    # copies; an accelerator's leave the accumulator out and, across
    # devices, hold the gradient beside them, and the operand of the
    # gradients' combined all-reduce (below); one device's update reads
    # each gradient as it is made (`accelerator_peak`). Counted as a copy
    # of each gradient at any size and on one device too, that operand put
    # one GPU's 1B-parameter Llama at batch 128 x 2048 over a 48 GiB budget
    # by 0.1 GiB with every accumulation.
    updated = 2 * (2 + slots)
    if accelerator:
        updated = (2 + slots) + (1 + slots) + (not one_device)
    unread = set(graph.unread)
    for tensor in graph.tensors:
        if tensor.kind == "state":
            add(tensor, True, 1.0)
        elif tensor.kind == "param":
            # An unread parameter's gradient is zero, folded by XLA; on an
            # accelerator the top stages, which keep every activation, hold
            # no gradient yet (the top layer's are left to the headroom); the
            # lowest stages, which hold them all, have rows of their own
            # (`_lowest_stage_rows`).
            gradient = 1.0 if tensor.id in unread or accelerator else 0.0
            add(tensor, True, copies - gradient if train else 1.0, updated)
        elif tensor.kind == "input":
            add(tensor, False, part)
    if options.job == "inference":  # the predictions predict returns
        for tid in graph.outputs:
            tensor = graph.tensors[tid]
            add(tensor, False, widening(tensor, half))
    if not train and not accelerator:  # XLA:CPU makes every relayout first
        for tensor in relaid_weights(graph):
            add(tensor, False, widening(tensor, half))
    if options.job == "generate":
        for pair in graph.key_values:
            for tid in pair:
                add(graph.tensors[tid], False, 1.0)
    # The state alone (parameters, gradients, slots, data), for the phase
    # at the end of the backward pass (`_gathered_weight_row`).
    state_terms, state_fixed = dict(row), constant
    if train:
        # Kept activations are freed by the update (after the backward pass).
        constant += graph.other_residual_bytes * part
        for tid, factor in kept_terms(graph, remat):
            tensor = graph.tensors[tid]
            add(tensor, False, factor * kept_widening(graph, tensor, half) * part, 0.0)
        for tid, factor in gathered_param_terms(graph, remat):
            # The gathered copy (compute layout) less the stored shard.
            add(graph.tensors[tid], False, factor, 0.0)
            add(graph.tensors[tid], True, -factor, 0.0)
        data_ways = math.prod(a.size for a in program.axes if a.data_only)
        for tid in graph.outputs:
            tensor = graph.tensors[tid]
            if tensor.requires_grad:
                constant += tensor.nbytes / data_ways * part
                update_constant += tensor.nbytes / data_ways * part
                add(tensor, False, 2.0 * widening(tensor, half) * part, 0.0)
    transient = program.lp.add_var(upper=np.inf)
    row[transient] = row.get(transient, 0.0) + 1.0
    for tensor, factor in _transient_candidates(graph, train, half, part, accelerator):
        fixed, terms = program.bytes_terms(tensor, fsdp=False, scale=factor)
        bound = {transient: 1.0}
        for var, coefficient in terms.items():
            bound[var] = bound.get(var, 0.0) - coefficient
        program.lp.add_row(bound, lower=fixed)
    if update is not None and accelerator and not one_device:
        for tensor, share in _combined_shares(graph):
            fixed, terms = program.bytes_terms(tensor, fsdp=False, scale=share)
            update_constant += fixed
            for var, coefficient in terms.items():
                update[var] = update.get(var, 0.0) + coefficient
    rows = [(row, constant)]
    if train and not accelerator:
        rows.append(_gathered_weight_row(program, remat, state_terms, state_fixed))
    if update is not None:
        rows.append((update, update_constant))
    if train and accelerator:
        rows += _lowest_stage_rows(program, remat, part, transient)
    if budget is None:
        # Minimise the peak first, communication second. The peak is counted
        # in MiB: in bytes, its coefficients at real sizes (1e15) leave the
        # solver's tolerances behind.
        ceiling = sum(t.nbytes for t in graph.tensors) * (4.0 + options.optimizer_slots)
        peak = program.lp.add_var(cost=PEAK_WEIGHT * MIB, upper=ceiling / MIB)
        for terms, fixed in rows:
            scaled = {var: coefficient / MIB for var, coefficient in terms.items()}
            scaled[peak] = -1.0
            program.lp.add_row(scaled, upper=-fixed / MIB)
        return
    fixed_most = max(fixed for _, fixed in rows)
    if fixed_most > budget:
        raise InfeasibleError(
            f"Even fully sharded, {fixed_most / 2**20:.1f} "
            "MiB per device cannot be cut (replicated parts)."
        )
    for terms, fixed in rows:
        program.lp.add_row(terms, upper=budget - fixed)


# How many of an accelerator's lowest backward stages get a row of their own
# (`_lowest_stage_rows`).
LOWEST_STAGES = 3


def _lowest_stage_rows(
    program: MilpProgram, remat: frozenset[str], part: float, transient: int
) -> list[tuple[dict[int, float], float]]:
    """Rows for the last stages of an accelerator's backward pass (the
    lowest layers'), where every finished gradient is held
    (`accelerator_peak.accelerator_peak`): the state, every gradient, one
    combined reduction of them, the data and targets, what those stages
    still keep (their own residuals and the activations kept for them) and
    the transient `T`.

    The first row (`add_peak_budget`) covers the top stages: every kept
    activation, no gradient. Going down, the gradients held grow and the
    activations kept shrink, each by about a layer's worth per stage, so
    the fullest stage is at one end; the `LOWEST_STAGES` lowest get a row
    each (the lowest layer may be an embedding that keeps little, so the
    next ones are checked too). Gathered copies of FSDP-cut weights are
    left out (the lowest layers' own are small against every gradient).

    Returns:
        `(terms, constant)` per row, in bytes per device.
    """
    graph = program.graph
    options = program.options
    slots = options.optimizer_slots
    accumulator = 1.0 if part < 1.0 else 0.0
    # One device holds a copy of the accumulators (`accelerator_peak`).
    accumulator_copy = accumulator if not program.axes else 0.0
    unread = set(graph.unread)
    state: dict[int, float] = {transient: 1.0}
    state_constant = 0.0

    def add(into: dict[int, float], tensor, fsdp: bool, scale: float) -> float:
        fixed, terms = program.bytes_terms(tensor, fsdp=fsdp, scale=scale)
        for var, coefficient in terms.items():
            into[var] = into.get(var, 0.0) + coefficient
        return fixed

    for tensor in graph.tensors:
        if tensor.kind == "state":
            state_constant += add(state, tensor, True, 1.0)
        elif tensor.kind == "param":
            copies = 1.0 + slots + accumulator + accumulator_copy
            copies += tensor.id not in unread
            state_constant += add(state, tensor, True, copies)
        elif tensor.kind == "input":
            state_constant += add(state, tensor, False, part)
    data_ways = math.prod(a.size for a in program.axes if a.data_only)
    for tid in graph.outputs:
        if graph.tensors[tid].requires_grad:
            state_constant += graph.tensors[tid].nbytes / data_ways * part
    if program.axes:  # one device reduces nothing
        for tensor, share in _combined_shares(graph):
            state_constant += add(state, tensor, False, share)
    rows = []
    kept: dict[int, float] = {}
    kept_constant = 0.0
    stages = accelerator_stages(graph, remat)
    for stage in stages[: max(1, min(LOWEST_STAGES, len(stages) - 1))]:
        for tid, factor in stage.kept_to_here:
            kept_constant += add(kept, graph.tensors[tid], False, factor * part)
        terms = dict(state)
        for var, coefficient in kept.items():
            terms[var] = terms.get(var, 0.0) + coefficient
        fixed = state_constant + kept_constant
        for tid, factor in stage.own:
            fixed += add(terms, graph.tensors[tid], False, factor * part)
        rows.append((terms, fixed))
    return rows


def _gathered_weight_row(
    program: MilpProgram,
    remat: frozenset[str],
    state_terms: Terms,
    state_fixed: float,
) -> tuple[Terms, float]:
    """The phase of `memory_model.gathered_weight_bytes`: the state, and the
    weight stored cut for storage (FSDP) that adds most while its layer's
    gradient is formed (its gathered copy and whole gradient, less its
    stored shard each); `(terms, fixed)` of the row."""
    cut_for_storage = {name for name, _ in program.y}
    widest = program.lp.add_var(upper=np.inf)
    for tensor, copies in gathered_weight_copies(program.graph, remat):
        if tensor.name not in cut_for_storage:
            continue
        whole_fixed, whole = program.bytes_terms(tensor, fsdp=False, scale=copies)
        stored_fixed, stored = program.bytes_terms(tensor, fsdp=True, scale=copies)
        bound = {widest: 1.0}
        for var, coefficient in whole.items():
            bound[var] = bound.get(var, 0.0) - coefficient
        for var, coefficient in stored.items():
            bound[var] = bound.get(var, 0.0) + coefficient
        program.lp.add_row(bound, lower=whole_fixed - stored_fixed)
    return {**state_terms, widest: 1.0}, state_fixed


def _transient_candidates(
    graph, train: bool, half: bool, part: float = 1.0, accelerator: bool = False
):
    """(tensor, buffers of its size) that may be the largest transient: on
    an accelerator one buffer of a batch activation in training (the
    gradient being formed), on XLA:CPU three."""

    batch_classes = batch_carrying_classes(graph)
    outputs = set(graph.outputs)
    # Tensors cut by the same classes shrink by the same factor under any
    # sharding, so the largest of each class set bounds all of that set.
    largest: dict[frozenset, tuple[float, int]] = {}
    for tensor in graph.tensors:
        if tensor.kind != "activation" or tensor.id in outputs or not tensor.nbytes:
            continue  # an empty tensor (a kernel's unused operand) holds nothing
        carries_batch = bool(batch_classes.intersection(tensor.dim_classes))
        if train:
            factor = (1.0 if accelerator else 3.0) * part if carries_batch else 1.0
        else:  # a layer's input and output; one weight-derived copy
            factor = 2.0 if carries_batch else 1.0
        factor *= widening(tensor, half)
        key = frozenset(c for c in tensor.dim_classes if c is not None)
        size = tensor.nbytes * factor
        if key not in largest or size > largest[key][0]:
            largest[key] = (size, tensor.id)
    chosen = []
    for size, tid in sorted(largest.values(), key=lambda item: (-item[0], item[1])):
        tensor = graph.tensors[tid]
        chosen.append((tensor, size / tensor.nbytes))
    if train:
        chosen += [
            (graph.tensors[t], f * part * widening(graph.tensors[t], half))
            for t, f in graph.workspaces
        ]
    return chosen


def _combined_shares(graph) -> list[tuple[object, float]]:
    """One combined reduction of the gradients
    (`accelerator_peak.accelerator_peak`): `(parameter, share)` for each
    parameter the step reads, in its compute layout, all of each while
    together they are under XLA's `COMBINE_THRESHOLD_BYTES`; past it, that
    share of each (a row must be linear)."""
    unread = set(graph.unread)
    read = [t for t in graph.tensors if t.kind == "param" and t.id not in unread]
    share = min(1.0, COMBINE_THRESHOLD_BYTES / max(1, sum(t.nbytes for t in read)))
    return [(tensor, share) for tensor in read]
