"""The layouts the automatic planner is judged against.

Hand-written Megatron-style rules for KerasHub transformer backbones, the
baseline a careful engineer writes by hand (column-parallel Q/K/V and
MLP-up, row-parallel attention output and MLP-down, vocabulary-parallel
embedding), and KerasHub's own `get_layout_map`. They rely on KerasHub's
layer names; the planner does not.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence

import keras

from keras_autoshard.apply.jax.device_mesh import make_device_mesh
from keras_autoshard.plans.mesh import DATA_AXIS, MODEL_AXIS
from keras_autoshard.plans.rules import Spec, plan_from_rules
from keras_autoshard.plans.sharding_plan import MeshSpec, ShardingPlan
from keras_autoshard.plans.validation import validate_plan_structure
from keras_autoshard.trace.naming import names_replayed_after

ModelBuilder = Callable[[], keras.Model]

# Megatron column/row rules for the benchmark MLP block (non-KerasHub models).
MLP_MEGATRON_RULES = {
    "up/kernel": (None, MODEL_AXIS),
    "up/bias": (MODEL_AXIS,),
    "down/kernel": (MODEL_AXIS, None),
}


class StrategyNotApplicable(Exception):
    """This layout has nothing to offer for this model (reported as n/a)."""


def keras_hub_megatron_rules(
    paths: Sequence[str], model_axis: str, vocab_divisible: bool = True
) -> dict[str, Spec]:
    """Megatron rules for GPT-2 / BERT / OPT / Gemma / Llama style backbones.

    Only rules that match some path in `paths` are returned, so the result can
    be applied with `plan_from_rules` (which rejects unused rules).

    Args:
        paths: The model's variable paths.
        model_axis: Mesh axis for tensor parallelism.
        vocab_divisible: Shard the token embedding's vocabulary dim.

    Returns:
        Regular expression → spec.
    """
    m = model_axis
    candidates: dict[str, Spec] = {
        # (hidden, heads, head_dim) kernels: GPT-2, BERT, OPT, Llama.
        r".*attention[^/]*/(query|key|value)/kernel": (None, m, None),
        r".*attention[^/]*/(query|key|value)/bias": (m, None),
        r".*attention[^/]*/attention_output/kernel": (m, None, None),
        r".*feedforward_(intermediate|gate)_dense/kernel": (None, m),
        r".*feedforward_(intermediate|gate)_dense/bias": (m,),
        r".*feedforward_output_dense/kernel": (m, None),
        # Gemma: (heads, hidden, head_dim) kernels and gated MLP.
        r"decoder_block_\d+/attention/(query|key|value)/kernel": (m, None, None),
        r".*ffw_gating(_2)?/kernel": (None, m),
        r".*ffw_linear/kernel": (m, None),
    }
    if vocab_divisible:
        candidates[r"(.*/)?token_embedding/embeddings"] = (m, None)
        candidates[r"(.*/)?token_embedding/reverse_embeddings"] = (None, m)
    used = {}
    for pattern, spec in candidates.items():
        if any(re.fullmatch(pattern, p) for p in paths):
            used[pattern] = spec
    # The Gemma pattern also matches the generic one; keep only the specific.
    gemma = r"decoder_block_\d+/attention/(query|key|value)/kernel"
    generic = r".*attention[^/]*/(query|key|value)/kernel"
    if gemma in used and generic in used:
        del used[generic]
    return used


def keras_hub_megatron_plan(
    model, mesh: MeshSpec, model_axis: str = "model", batch_axis: str = "batch"
) -> ShardingPlan:
    """The hand-written Megatron plan for a KerasHub backbone on `mesh`.

    Args:
        model: A built KerasHub backbone.
        mesh: The mesh; must contain `model_axis` and `batch_axis`.
        model_axis: Mesh axis for tensor parallelism.
        batch_axis: Mesh axis for data parallelism.

    Returns:
        A `ShardingPlan` (variables no rule names are replicated).
    """
    variables = list({id(v): v for v in model.variables}.values())
    paths = [v.path for v in variables]
    vocab_sizes = [
        v.shape[0] for v in variables if v.path.endswith("token_embedding/embeddings")
    ]
    divisible = all(size % mesh.axis_size(model_axis) == 0 for size in vocab_sizes)
    rules = keras_hub_megatron_rules(paths, model_axis, vocab_divisible=divisible)
    plan = plan_from_rules(
        variables, mesh, rules, batch_axis=batch_axis, check_structure=False
    )
    # As an engineer would for GQA/MQA: replicate what the axis cannot split.
    size = mesh.axis_size(model_axis)
    fixed = {
        v.path: tuple(
            None if axis == model_axis and v.shape[d] % size else axis
            for d, axis in enumerate(v.spec)
        )
        for v in plan.variables
    }
    changed = {p: spec for p, spec in fixed.items() if spec != plan.variable(p).spec}
    if changed:
        plan = plan.replace_specs(changed, reason="replicated: does not divide")
    validate_plan_structure(plan)
    return plan


def keras_hub_layout_map(
    build_model: ModelBuilder, mesh: MeshSpec
) -> keras.distribution.ModelParallel:
    """`ModelParallel` with the backbone class's own `get_layout_map`.

    Args:
        build_model: Builds the model (under `names_replayed_after`, so the
            next build's variable paths are unchanged).
        mesh: A mesh with "batch" and "model" axes.

    Returns:
        The distribution.

    Raises:
        StrategyNotApplicable: the class has no `get_layout_map`, or its map
            shards a dim the mesh axis does not divide.

    Example:

    ```python
    distribution = keras_hub_layout_map(build, MeshSpec((2, 4), ("batch", "model")))
    ```
    """
    with names_replayed_after():
        reference = build_model()
    get_layout_map = getattr(type(reference), "get_layout_map", None)
    if get_layout_map is None:
        raise StrategyNotApplicable(f"{type(reference).__name__} has no get_layout_map")
    layout_map = get_layout_map(
        make_device_mesh(mesh),
        model_parallel_dim_name=MODEL_AXIS,
        data_parallel_dim_name=DATA_AXIS,
    )
    _check_layouts_divide(reference, layout_map, mesh)
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name=DATA_AXIS
    )


def _check_layouts_divide(
    model: keras.Model, layout_map: keras.distribution.LayoutMap, mesh: MeshSpec
) -> None:
    """Raise `StrategyNotApplicable` where the map shards a dim it cannot split.

    Keras would fail while building the model; the report lists the reason.
    """
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    for variable in model.variables:
        layout = layout_map[variable.path]
        if layout is None:
            continue
        for dim, (size, axis) in enumerate(zip(variable.shape, layout.axes)):
            if axis is not None and size % sizes[axis]:
                raise StrategyNotApplicable(
                    f"the KerasHub layout map shards dim {dim} (size {size}) of "
                    f"{variable.path!r} over {axis!r} ({sizes[axis]} devices), "
                    "which does not divide it"
                )


def handwritten_plan(model: keras.Model, mesh: MeshSpec) -> ShardingPlan:
    """The Megatron plan an engineer writes by hand for `model`.

    KerasHub backbones get `keras_hub_megatron_plan`; other models get the
    column/row rules of the benchmark MLP block (`MLP_MEGATRON_RULES`).

    Args:
        model: A built model.
        mesh: A mesh with "batch" and "model" axes.

    Returns:
        The plan.
    """
    if _is_keras_hub_backbone(model):
        return keras_hub_megatron_plan(
            model, mesh, model_axis=MODEL_AXIS, batch_axis=DATA_AXIS
        )
    return plan_from_rules(
        model.variables, mesh, MLP_MEGATRON_RULES, batch_axis=DATA_AXIS
    )


def _is_keras_hub_backbone(model: keras.Model) -> bool:
    # A model can only be a KerasHub backbone if KerasHub was imported to
    # build it; checking first keeps MLP-only runs from importing it.
    if "keras_hub" not in sys.modules:
        return False
    import keras_hub

    return isinstance(model, keras_hub.models.Backbone)
