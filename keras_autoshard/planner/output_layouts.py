"""The layer outputs a plan pins (`ShardingPlan.activations`), and why.

Keras asks the distribution for a layout of every layer's output
(`Distribution.get_tensor_layout("<layer path>/output")`); the plan answers
for two kinds of layers:

- layers whose parameters are cut for storage only, where the pin moves
  fewer bytes than the cut XLA would carry (`storage_cut_layouts`);
- under sequence parallelism, every sub-layer of the layers it applies to
  (`planner/sequence_parallel.py`);
- for generation, the layers that make the keys and values a cache stores
  (`key_value_layouts`);
- for a model traced through its parts, the layers that read a part's
  batch (`made_batch_layouts`): the train step makes those batches.
"""

from __future__ import annotations

from collections.abc import Mapping

from keras_autoshard.graph.axis_graph import AxisGraph
from keras_autoshard.graph.layer_paths import keras_layer_path, scope_rewrites
from keras_autoshard.planner.cost_model import (
    Assignment,
    storage_cut_only,
    tensor_axes,
)
from keras_autoshard.planner.sequence_parallel import SequenceCut, pinned_layouts
from keras_autoshard.planner.stream_drift import StreamDrift, stream_drift
from keras_autoshard.plans.layouts import ActivationLayout


def output_layouts(
    graph: AxisGraph,
    assignment: Assignment,
    pinned: Mapping[str, tuple],
    sequence: SequenceCut | None = None,
    job: str = "train",
) -> tuple[tuple[ActivationLayout, ...], list[str]]:
    """The plan's pinned layer outputs and a note for each reason.

    Args:
        graph: The model's axis graph.
        assignment: The sharding (with its sequence cut, if any).
        pinned: Variable path → spec fixed by user rules.
        sequence: The sequence-parallel cut, if asked for.
        job: The planned job (`"generate"` pins the keys and values).

    Returns:
        `(layouts, notes)`.
    """
    rewrites = scope_rewrites(graph)
    storage = storage_cut_layouts(graph, assignment, pinned, job, rewrites)
    notes = _storage_notes(storage)
    layouts = dict(storage)
    if sequence is not None:
        notes.extend(sequence.notes)
        if sequence.layers:
            by_scope = pinned_layouts(graph, assignment, sequence)
            by_path = {
                f"{keras_layer_path(scope, rewrites)}/output": spec
                for scope, spec in by_scope.items()
            }
            layouts.update(by_path)
            notes.append(
                f"Sequence parallelism over {sequence.axis!r} in "
                f"{len(sequence.layers)} layer call(s): {len(by_path)} layer "
                "outputs pinned (the token dim cut between tensor-parallel "
                "regions, each region's own layouts inside)."
            )
    if job == "generate":
        cache = key_value_layouts(graph, assignment, rewrites)
        if cache:
            layouts.update(cache)
            notes.append(
                f"{len(cache)} layer outputs holding the keys and values of "
                "the generation cache pinned as planned, so that the cache "
                "made from them is laid out so too."
            )
    if graph.inputs_made_in_step:
        made, unpinned = made_batch_layouts(graph, assignment, rewrites)
        layouts.update(made)
        notes.extend(_made_batch_notes(made, unpinned))
    activations = tuple(ActivationLayout(path, spec) for path, spec in layouts.items())
    return activations, notes


def made_batch_layouts(
    graph: AxisGraph,
    assignment: Assignment,
    rewrites: Mapping[str, tuple[str, str]] | None = None,
) -> tuple[dict[str, tuple[str | None, ...]], list[str]]:
    """Pin the output of each layer that reads one of the graph's inputs,
    when those inputs are batches the train step makes
    (`AxisGraph.inputs_made_in_step`).

    A GAN's step draws its latent vectors and feeds the generated images
    to the discriminator: no data layout reaches them, so XLA would run a
    layer that reads them on every row on every device (measured on the
    GAN of `tests/trace/test_gan_train_step.py` on 8x1: the discriminator's
    convolution in the generator's loss ran on all 8 rows on every
    device). Each such layer's output gets its planned layout instead, the
    batch cut as planned.

    Returns:
        `(layouts, layers not pinned)`: a layer whose calls are laid out
        differently, or that returns several tensors, is not pinned
        (Keras asks one layout per layer path).
    """
    if rewrites is None:
        rewrites = scope_rewrites(graph)
    readers = sorted({scope for _, scopes in graph.input_readers for scope in scopes})
    layouts, unpinned = {}, []
    for scope in readers:
        layout = _layout_of_every_call(graph, scope, assignment)
        path = keras_layer_path(scope, rewrites)
        if layout is None:
            unpinned.append(path)
        else:
            layouts[f"{path}/output"] = layout
    return layouts, unpinned


def _made_batch_notes(made: Mapping[str, tuple], unpinned: list[str]) -> list[str]:
    notes = []
    if made:
        notes.append(
            f"{len(made)} layer outputs pinned as planned "
            f"({', '.join(sorted(made))}): these layers read the parts' "
            "batches, which the train step makes, so no data layout reaches "
            "them."
        )
    if unpinned:
        notes.append(
            f"Layers {sorted(unpinned)} read a part's batch but are not pinned "
            "(their calls are laid out differently, or they return several "
            "tensors): XLA lays out their batch from what they read."
        )
    return notes


def _storage_notes(storage: Mapping[str, tuple]) -> list[str]:
    """One note per pinned spec (a 70B model pins 161 norm outputs alike:
    one line, three of them named, not 161)."""
    by_spec: dict[tuple, list[str]] = {}
    for path, spec in storage.items():
        by_spec.setdefault(spec, []).append(path)
    notes = []
    for spec, paths in by_spec.items():
        if len(paths) == 1:
            notes.append(
                f"{paths[0]} pinned to {spec}: the layer's parameters are cut "
                "for storage only, so its output is laid out once instead of "
                "carrying their cut into every later layer."
            )
            continue
        named = ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")
        notes.append(
            f"{len(paths)} layer outputs pinned to {spec} ({named}): their "
            "layers' parameters are cut for storage only, so each output is "
            "laid out once instead of carrying their cut into every later layer."
        )
    return notes


def key_value_layouts(
    graph: AxisGraph,
    assignment: Assignment,
    rewrites: Mapping[str, tuple[str, str]] | None = None,
) -> dict[str, tuple[str | None, ...]]:
    """Pin the output of each layer that makes a key or value a cache stores
    (`AxisGraph.key_values`), as planned.

    KerasHub makes the cache inside `generate_step` (`ops.zeros`), where no
    Keras distribution hook reaches; XLA lays it out from what is written
    into it. Left alone, it kept OPT's cache whole on an 8x1 mesh (measured:
    2 MiB per device against 256 KiB cut by the batch); pinned, the keys
    and values carry the plan's layout into it. A key or value that is no
    layer's output (made inside a layer's call) is not pinned, nor one made
    by a layer whose other calls are planned another way: Keras asks one
    layout per layer path, so the pin would lay out every call alike
    (Llama's rotary embedding turns both the query and the key; pinning the
    key's whole heads gathered every query head, measured on 2x4).
    """
    if rewrites is None:
        rewrites = scope_rewrites(graph)
    made_by: dict[int, str] = {}
    for scope, outputs in graph.scope_outputs:
        for tid in outputs:
            # The innermost scope that returns it: the layer that made it.
            if len(scope) > len(made_by.get(tid, "")):
                made_by[tid] = scope
    layouts = {}
    for pair in graph.key_values:
        for tid in pair:
            if tid not in made_by:
                continue
            layout = _layout_of_every_call(graph, made_by[tid], assignment)
            if layout is not None:
                path = keras_layer_path(made_by[tid], rewrites)
                layouts[f"{path}/output"] = layout
    return layouts


def storage_cut_layouts(
    graph: AxisGraph,
    assignment: Assignment,
    pinned,
    job: str = "train",
    rewrites: Mapping[str, tuple[str, str]] | None = None,
) -> dict[str, tuple[str | None, ...]]:
    """Pin the output of each layer whose parameters are cut for storage only,
    where the pin moves fewer bytes than leaving the output to XLA.

    A parameter cut for storage only (FSDP) is meant to be gathered where it
    is used, the layer's output laid out like the plan's activations. Where
    the parameter is not a matmul operand (a lookup table, a position table
    added to the activations) the partitioner instead computes on the local
    slice and carries that slice's cut into the residual stream, paying an
    all-gather at every later use and an all-reduce in every norm (measured
    on KerasHub Gemma on a 1x8 mesh: 8 all-gathers of the activation instead
    of one; OPT's position table did the same along the sequence). A pin
    costs one all-gather of the output; so the output of the layer owning
    such a parameter gets the plan's layout of that output, read from the
    trace (Keras asks `"<layer path>/output"`), unless the cut it stops is
    one the stream is held cut by anyway (`stream_drift.stream_drift`):

    - a one-dimensional parameter read elementwise (a norm's scale, a bias)
      is such a source itself: its cut is carried into the stream by
      design, and pinning its layer's output whole gathers the activation
      only for the next layer to cut it again;
    - a table cut over an axis the stream is held cut over (OPT on 1x8
      under a tight budget: its norm scales and token table cut over
      `model` on the hidden dim, its position table over `model` on the
      positions): the lookup's output is re-cut into the stream's cut at
      the first residual add (an all-to-all of a position table's output);
      pinned whole, it is gathered first.

    Measured on that OPT plan (`tests/planner/test_planner_vs_baselines.py`): every
    storage-cut layer pinned moved 7.34 MB per step, the two lookups only
    7.02 MB, the position lookup only 6.95 MB, no pin 6.90 MB; this rule
    pins none there, and still pins Gemma's lookup where nothing else cuts
    the stream (one all-gather instead of eight).

    A layer called more than once (a tied reverse projection) is pinned only
    when every call's output has the same rank and planned layout.

    A layer whose trace scope is not its Keras path (a subclassed model's,
    `layer_paths.scope_rewrites`) is pinned for inference and generation
    only: measured on the zoo's tied model (subclassed) predicting on 8x1,
    unpinned its embedding's cut made XLA keep the logits whole (estimate
    ÷ compiled 0.33), pinned 0.93; while training the zoo's subclassed
    model under rematerialization on 2x4, pinning raised the compiled peak
    from 3.35 to 4.10 MB, over the budget it was planned for.
    """
    train = job == "train"
    if rewrites is None:
        rewrites = scope_rewrites(graph)
    scope_of = {
        keras_layer_path(scope, rewrites): scope for scope, _ in graph.scope_outputs
    }
    drift = stream_drift(graph, assignment)
    layouts = {}
    for tensor in graph.params():
        if tensor.name in pinned or not storage_cut_only(tensor, assignment):
            continue
        if not _pin_stops_a_cut(tensor, assignment, drift):
            continue
        layer_path = tensor.name.rpartition("/")[0]
        scope = layer_path if train else scope_of.get(layer_path, layer_path)
        layout = _layout_of_every_call(graph, scope, assignment) if layer_path else None
        if layout is not None:
            layouts[f"{layer_path}/output"] = layout
    return layouts


def _pin_stops_a_cut(tensor, assignment: Assignment, drift: StreamDrift) -> bool:
    """Whether pinning the output of `tensor`'s layer stops a storage cut
    that the stream would not carry anyway: `tensor` is no drift source and
    one of its cuts is over an axis the stream is not held cut over (where
    it is, the output is re-cut over that axis at the first residual add,
    whatever its own cut: a pin would gather it only for that)."""
    if tensor.name in drift.sources:
        return False
    held_over = set(drift.classes.values())
    return any(axis not in held_over for _, axis in assignment.fsdp[tensor.name])


def _layout_of_every_call(
    graph: AxisGraph, scope: str, assignment: Assignment
) -> tuple[str | None, ...] | None:
    """The planned layout of the output of every call of the layer at
    `scope`, or `None` when the calls differ (Keras asks one layout per
    layer path), a call returns several tensors (Keras would give each the
    one layout, and a functional model's build hands the tuple of symbolic
    tensors to `jax.device_put`) or there is none."""
    if scope in graph.several_outputs:
        return None
    layouts = {
        tensor_axes(graph.tensors[t], assignment) for t in graph.layer_outputs(scope)
    }
    return layouts.pop() if len(layouts) == 1 else None
