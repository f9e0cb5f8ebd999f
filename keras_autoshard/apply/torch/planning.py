"""Planning for the torch backend: the JAX planner, once, on rank 0.

Rank 0 runs the JAX planning subprocess of
`keras_autoshard.planner.subprocess_planning`; the plan reaches the other
ranks through torchrun's rendezvous store, and each rank aligns it with its
own model's variable paths.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Mapping
from typing import Any

import keras

from keras_autoshard.planner.subprocess_planning import (
    PLANNING_TIMEOUT_S,
    plan_from_worker_result,
    planning_request,
    run_plan_worker,
)
from keras_autoshard.plans.rules import Spec
from keras_autoshard.plans.sharding_plan import MeshSpec, ShardingPlan

RANK_ZERO_WAIT_S = PLANNING_TIMEOUT_S + 60
_SHARED_COUNT = 0


def plan_for_torch(
    model: keras.Model,
    device_mesh: MeshSpec,
    sample_input,
    memory_budget: int | str | None = None,
    rules: Mapping[str, Spec] | None = None,
    batch_over_model_axes: bool = True,
) -> ShardingPlan:
    """Plan a torch-backend model with the JAX planner; the same plan on all ranks.

    Args:
        model: A built Keras model whose class can be serialised (KerasHub
            backbones, functional and Sequential models, registered
            subclasses).
        device_mesh: The mesh to plan for.
        sample_input: One global batch of inputs (arrays or anything with
            `shape` and `dtype`).
        memory_budget: Per-device bytes (a number, or a string such as
            `"16GiB"`) for parameters and optimizer state.
        rules: Regular expression on variable path → spec, pinned.
        batch_over_model_axes: `plan()`'s (`TensorParallel`: `False`).

    Returns:
        The plan, with the local model's variable paths.

    Raises:
        PlanError: the model cannot be serialised or planned (the message
            says which and how to plan it under JAX instead).
    """
    request = planning_request(
        model, device_mesh, sample_input, memory_budget, rules, batch_over_model_axes
    )
    result = _on_rank_zero(lambda: run_plan_worker(request))
    return plan_from_worker_result(result, model)


def _on_rank_zero(compute) -> dict[str, Any]:
    """`compute()` on rank 0, its result broadcast to every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return compute()
    # Through the rendezvous store, not a collective: planning a large model
    # can outlast the process group's timeout (kept short so a dead rank
    # stops the others quickly).
    from torch.distributed.distributed_c10d import _get_default_store

    global _SHARED_COUNT
    _SHARED_COUNT += 1
    key = f"keras_autoshard/rank0/{_SHARED_COUNT}"
    store = _get_default_store()
    if dist.get_rank() == 0:
        result = compute()
        store.set(key, pickle.dumps(result))
        return result
    store.wait([key], datetime.timedelta(seconds=RANK_ZERO_WAIT_S))
    return pickle.loads(store.get(key))
