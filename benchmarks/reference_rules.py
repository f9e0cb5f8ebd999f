"""Hand-written Megatron-style rules for KerasHub transformer backbones.

These are the baseline a careful engineer writes by hand (column-parallel
Q/K/V and MLP-up, row-parallel attention output and MLP-down, vocabulary-
parallel embedding), used by the tests and benchmarks to judge the automatic
planner. They rely on KerasHub's layer names; the planner does not.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from keras_autoshard.plans.rules import Spec, plan_from_rules
from keras_autoshard.plans.sharding_plan import MeshSpec, ShardingPlan
from keras_autoshard.plans.validation import validate_plan_structure


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
