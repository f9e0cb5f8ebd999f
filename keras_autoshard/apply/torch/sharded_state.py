"""Model and optimizer variables as DTensors that hold only this rank's shard.

Trainable variables become DTensors with the plan's placements (replicated
ones too, so DTensor all-reduces their gradients over the data axis).
Non-trainable replicated variables (seed-generator states, moving statistics)
stay plain tensors: DTensor's implicit replication treats them as replicated.
Adam-style slots take their parameter's placements.
"""

from __future__ import annotations

import dataclasses

import keras

from keras_autoshard.apply.optimizer_slots import slot_owner, slot_prefix
from keras_autoshard.apply.torch.abstract_build import (
    initial_value,
    is_materialised,
    mark_materialised,
)
from keras_autoshard.apply.torch.dtensor_layout import placements_for
from keras_autoshard.compat import keras_private, keras_variables
from keras_autoshard.io.torch.dtensor_shards import local_slice_index
from keras_autoshard.plans.sharding_plan import PlanError, ShardingPlan


@dataclasses.dataclass(frozen=True)
class RankStateBytes:
    """Bytes this rank holds.

    Args:
        parameters: Local bytes of the model's variables.
        optimizer: Local bytes of the optimizer's variables.
        sharded_parameters_total: Global bytes of the variables the plan cuts.
        replicated_parameters_total: Global bytes of the variables it does not.
    """

    parameters: int
    optimizer: int
    sharded_parameters_total: int
    replicated_parameters_total: int


def shard_model_variables(
    model: keras.Model,
    plan: ShardingPlan,
    device_mesh,
    init_seed: int = 0,
    initialise: bool = True,
) -> None:
    """Replace each variable's value by a DTensor holding this rank's shard.

    A built variable's full value is scattered from rank 0
    (`distribute_tensor`), so every rank ends with rank 0's initial weights;
    the full copy is then dropped. A deferred variable (`build_abstract`) gets
    only its block, computed from its initializer (see
    `abstract_build.initial_value`): no full copy of the model exists.

    Args:
        model: A built Keras model (torch backend).
        plan: Its plan; every variable must be in it.
        device_mesh: The torch `DeviceMesh` of `plan.mesh`.
        init_seed: Seed of deferred variables' initial values.
        initialise: Whether deferred variables get their initial values;
            `False` leaves their blocks uninitialised memory, for a caller
            that fills every variable next (from a weights file).
    """
    import torch
    from torch.distributed.tensor import distribute_tensor

    _check_covered(model, plan)
    materialised = []
    for index, variable in enumerate(_unique(model.variables)):
        spec = plan.variable(variable.path).spec
        placements = placements_for(spec, plan.mesh)
        if not is_materialised(variable):
            keep_whole = not variable.trainable and all(a is None for a in spec)
            if initialise:
                value = initial_value(variable, index, init_seed)
                local = (
                    value.to(device_mesh.device_type)
                    if keep_whole
                    else _local_block(value, device_mesh, placements)
                )
                del value
            else:
                local = _empty_block(variable, device_mesh, placements, keep_whole)
            keras_variables.set_value(
                variable, torch.nn.Parameter(local, requires_grad=variable.trainable)
            )
            materialised.append(variable)
            continue
        if not variable.trainable and all(axis is None for axis in spec):
            continue
        value = variable.value.detach()
        sharded = distribute_tensor(value, device_mesh, placements)
        keras_variables.set_value(
            variable, torch.nn.Parameter(sharded, requires_grad=variable.trainable)
        )
    mark_materialised(materialised)


def _empty_block(variable, device_mesh, placements, keep_whole: bool):
    """Uninitialised storage for this rank's block of a deferred variable."""
    import torch
    from torch.distributed.tensor import empty as dtensor_empty

    shape = tuple(variable.shape)
    dtype = keras_private.to_torch_dtype(variable.dtype)
    if keep_whole:
        return torch.empty(shape, dtype=dtype, device=device_mesh.device_type)
    return dtensor_empty(
        shape, dtype=dtype, device_mesh=device_mesh, placements=placements
    )


def _local_block(value, device_mesh, placements):
    """A DTensor of `value`'s global shape holding only this rank's block
    (cut locally: every rank computed the same `value`)."""
    from torch.distributed.tensor import empty as dtensor_empty

    sharded = dtensor_empty(
        tuple(value.shape),
        dtype=value.dtype,
        device_mesh=device_mesh,
        placements=placements,
    )
    local = sharded.to_local()
    local.copy_(value[local_slice_index(sharded)])
    return sharded


def shard_optimizer_variables(model: keras.Model) -> None:
    """Build the optimizer and give every slot its parameter's placements.

    Slots are created as zeros directly in their shard (no full copy); the
    iteration counter and learning rate stay plain replicated scalars.
    """
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import zeros as dtensor_zeros

    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    owners = {
        slot_prefix(v.path): (v, v.value)
        for v in model.trainable_variables
        if isinstance(v.value, DTensor)
    }
    for slot in optimizer.variables:
        owner = slot_owner(slot, owners)
        if owner is None or isinstance(slot.value, DTensor):
            continue
        parameter_value = owner[1]
        keras_variables.set_value(
            slot,
            torch.nn.Parameter(
                dtensor_zeros(
                    tuple(slot.shape),
                    dtype=slot.value.dtype,
                    device_mesh=parameter_value.device_mesh,
                    placements=parameter_value.placements,
                ),
                requires_grad=False,
            ),
        )


def rank_state_bytes(model: keras.Model, plan: ShardingPlan) -> RankStateBytes:
    """What this rank holds, read off the tensors' local shards."""
    optimizer = getattr(model, "optimizer", None)
    optimizer_variables = optimizer.variables if optimizer is not None else []
    sharded = sum(
        v.total_bytes
        for v in plan.variables
        if any(axis is not None for axis in v.spec)
    )
    replicated = sum(
        v.total_bytes for v in plan.variables if all(axis is None for axis in v.spec)
    )
    return RankStateBytes(
        parameters=sum(local_bytes(v.value) for v in _unique(model.variables)),
        optimizer=sum(local_bytes(v.value) for v in _unique(optimizer_variables)),
        sharded_parameters_total=sharded,
        replicated_parameters_total=replicated,
    )


def local_bytes(value) -> int:
    """Bytes of the part of `value` this rank stores."""
    from torch.distributed.tensor import DTensor

    local = value.to_local() if isinstance(value, DTensor) else value
    return local.numel() * local.element_size()


def _unique(variables):
    seen = set()
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            yield variable


def _check_covered(model: keras.Model, plan: ShardingPlan) -> None:
    missing = [v.path for v in model.variables if plan.get(v.path) is None]
    if missing:
        raise PlanError(
            f"The plan has no entry for {len(missing)} variable(s) of the model, "
            f"e.g. {missing[:3]}. Plan this model (paths must match) or align "
            "the plan with `align_plan(plan, planned_paths, model)`."
        )
    for variable in model.variables:
        planned = plan.variable(variable.path)
        if tuple(planned.shape) != tuple(variable.shape):
            raise PlanError(
                f"Variable {variable.path!r} has shape {tuple(variable.shape)} but "
                f"the plan says {planned.shape}: the plan is for another model."
            )
