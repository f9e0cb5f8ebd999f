"""`save_checkpoint` / `restore_checkpoint` on the PyTorch backend, with
`torch.distributed.checkpoint` (DCP).

A step is `<directory>/<step>/`: DCP's files (each rank writes its own
shards, `.metadata` lists them) and `keras_autoshard.json` (format, step,
plan, the wrapped model's Keras config, the caller's metadata, the
data-iterator state, and the name, shape and dtype of every saved tensor).
Tensors are named by Keras's weights-file keys (`model/layers/dense/vars/0`)
and the optimizer's variable order (`optimizer/<i>`), so a checkpoint
restores onto any rank count or mesh shape (DCP reshards on load) and onto
one process.

Every rank writes into `<step>.partial/`; rank 0 renames it to `<step>/`
once every rank has finished and the JSON is written, so a save killed part
way leaves no step directory and the previous step stays the latest.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from keras_autoshard.checkpoint.sharded_load import weights_owner
from keras_autoshard.checkpoint.steps import TORCH_INFO_FILE
from keras_autoshard.errors import CheckpointError
from keras_autoshard.io.keras_weights_layout import weight_file_entries
from keras_autoshard.io.torch.dtensor_shards import is_dtensor

TORCH_FORMAT = "keras-autoshard/torch-dcp"
PARTIAL_SUFFIX = ".partial"


def torch_state(model) -> dict[str, Any]:
    """Name → tensor (DTensor or plain) of every model and optimizer variable.

    Args:
        model: A Keras model on the torch backend, or its `TensorParallel`
            wrapper (the wrapped model's variables, the wrapper's optimizer).

    Returns:
        `{"model/<weights-file key>": tensor, "optimizer/<i>": tensor}`.
    """
    state = {
        f"model/{key}": variable.value
        for key, variable in weight_file_entries(weights_owner(model)).items()
    }
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        for index, variable in enumerate(optimizer.variables):
            state[f"optimizer/{index}"] = variable.value
    return state


def save_checkpoint_torch(
    model,
    directory: str,
    step: int,
    info: dict[str, Any],
    max_to_keep: int | None = None,
) -> str:
    """Write step `step` with DCP; every rank must call it.

    Args:
        model: The model or wrapper (see `torch_state`).
        directory: Checkpoint root.
        step: Step number; an existing step is an error.
        info: What goes into `keras_autoshard.json` besides the tensors.
        max_to_keep: Keep only this many latest complete steps.

    Returns:
        The step directory.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    final = os.path.join(directory, str(step))
    partial = final + PARTIAL_SUFFIX
    if os.path.exists(final):
        raise CheckpointError(
            f"Step {step} exists in {directory}; a step is never overwritten: "
            "use a new step number."
        )
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a killed earlier try
        os.makedirs(partial)
    _barrier(distributed)
    state = torch_state(model)
    dcp.save(state, checkpoint_id=partial, no_dist=not distributed)
    _barrier(distributed)
    if rank == 0:
        tensors = {
            name: {"shape": list(value.shape), "dtype": str(value.dtype)}
            for name, value in state.items()
        }
        record = dict(info, format=TORCH_FORMAT, step=step, tensors=tensors)
        with open(os.path.join(partial, TORCH_INFO_FILE), "w") as file:
            json.dump(record, file)
        os.replace(partial, final)
        _drop_old_steps(directory, max_to_keep)
    _barrier(distributed)
    return final


def check_save_arguments(wait: bool, progress: bool) -> None:
    """Refuse what the PyTorch backend's save cannot do, before any rank
    writes: every rank raises the same error."""
    unsupported = {
        "wait=False": not wait,
        "progress=True": progress,
    }
    asked = [argument for argument, given in unsupported.items() if given]
    if asked:
        raise CheckpointError(
            f"save_checkpoint({', '.join(asked)}) is not supported on the PyTorch "
            "backend: torch.distributed.checkpoint writes every rank's shards "
            "before save_checkpoint returns, with no progress to show. Call it "
            "with wait=True and progress=False (the defaults)."
        )


def restore_checkpoint_torch(model, path: str) -> dict[str, Any]:
    """Load step directory `path` into `model`'s tensors in place.

    Checks names, shapes and dtypes against the step's record before reading;
    DCP reads the blocks each rank's shards need.

    Returns:
        The step's `keras_autoshard.json` record.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    record = read_torch_info(path)
    _build_optimizer(model)
    state = torch_state(model)
    saved = record["tensors"]
    has_optimizer = any(n.startswith("optimizer/") for n in saved)
    if not has_optimizer:
        state = {n: t for n, t in state.items() if not n.startswith("optimizer/")}
    missing = sorted(set(state) - set(saved))
    extra = sorted(n for n in set(saved) - set(state) if n.startswith("model/"))
    if missing or extra:
        raise CheckpointError(
            f"Checkpoint {path} is from another model: {len(missing)} variables "
            f"not in it {missing[:6]}, {len(extra)} saved tensors with no "
            f"variable {extra[:6]}. Nothing was assigned."
        )
    for name, tensor in state.items():
        shape, dtype = saved[name]["shape"], saved[name]["dtype"]
        if list(tensor.shape) != shape or str(tensor.dtype) != dtype:
            raise CheckpointError(
                f"Checkpoint {path} holds {name} as {dtype} {shape}, the model "
                f"has {tensor.dtype} {list(tensor.shape)}. Nothing was assigned."
            )
    check_shard_files(path, set(state))
    distributed = dist.is_available() and dist.is_initialized()
    targets = {n: t if is_dtensor(t) else t.detach() for n, t in state.items()}
    try:
        dcp.load(targets, checkpoint_id=path, no_dist=not distributed)
    except Exception as error:
        raise CheckpointError(
            f"Reading checkpoint {path} failed ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:300]}): a shard file is missing or "
            "damaged. Restore another step."
        ) from error
    return record


def check_shard_files(path: str, names: set[str]) -> None:
    """Check that every shard file the step's DCP index lists for `names`
    exists and holds its bytes, before any rank reads: every rank checks
    the same index, so a missing or truncated file is the same error on
    every rank and no rank waits in a collective for another.

    Raises:
        CheckpointError: naming the file, the variable and what is wrong.
    """
    import torch.distributed.checkpoint as dcp

    try:
        index = dcp.FileSystemReader(path).read_metadata()
    except Exception as error:
        raise CheckpointError(
            f"Checkpoint {path}: its DCP index {os.path.join(path, '.metadata')} "
            f"cannot be read ({type(error).__name__}: {error}). Restore another "
            "step."
        ) from error
    sizes: dict[str, int | None] = {}
    for where, stored in index.storage_data.items():
        if where.fqn not in names:
            continue
        file = os.path.join(path, stored.relative_path)
        if file not in sizes:
            sizes[file] = os.path.getsize(file) if os.path.exists(file) else None
        end = stored.offset + stored.length
        if sizes[file] is None:
            raise CheckpointError(
                f"Checkpoint {path} is missing shard file {file}, which holds "
                f"{where.fqn} (block at {list(where.offset)}). A rank's files "
                "were lost or not copied; restore another step. Nothing was "
                "assigned."
            )
        if sizes[file] < end:
            raise CheckpointError(
                f"Checkpoint {path}: shard file {file} is truncated ({sizes[file]} "
                f"bytes; {where.fqn} (block at {list(where.offset)}) needs bytes "
                f"{stored.offset}..{end}). Restore another step. Nothing was "
                "assigned."
            )


def _build_optimizer(model) -> None:
    """Build (and shard, under the torch wrapper) an optimizer that has not
    run yet, so that its state can be restored into."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built:
        return
    optimizer.build(model.trainable_variables)
    if getattr(model, "_sharding", None) is not None:
        from keras_autoshard.apply.torch.sharded_state import (
            shard_optimizer_variables,
        )

        shard_optimizer_variables(model)


def read_torch_info(path: str) -> dict[str, Any]:
    """The `keras_autoshard.json` record of a torch step directory."""
    info = os.path.join(path, TORCH_INFO_FILE)
    if not os.path.exists(info):
        raise CheckpointError(
            f"{path} was not written by save_checkpoint on the PyTorch backend "
            "(an Orbax checkpoint of the JAX backend has no "
            f"{TORCH_INFO_FILE}). Checkpoints do not move across backends; "
            "weights do: save_weights('model.weights.h5') on one backend and "
            "load_weights it on the other (bit-exact both ways)."
        )
    try:
        with open(info) as file:
            record = json.load(file)
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"{info} cannot be read ({type(error).__name__}: {error}): the file "
            "is damaged. Restore another step."
        ) from error
    if not isinstance(record, dict) or record.get("format") != TORCH_FORMAT:
        raise CheckpointError(f"{info} is not a {TORCH_FORMAT} record.")
    return record


def is_torch_step(path: str) -> bool:
    """Whether a step directory was written by `save_checkpoint_torch`."""
    return os.path.exists(os.path.join(path, TORCH_INFO_FILE))


def _drop_old_steps(directory: str, max_to_keep: int | None) -> None:
    if max_to_keep is None:
        return
    steps = sorted(
        int(name)
        for name in os.listdir(directory)
        if name.isdigit() and is_torch_step(os.path.join(directory, name))
    )
    for old in steps[: max(0, len(steps) - max_to_keep)]:
        shutil.rmtree(os.path.join(directory, str(old)))


def _barrier(distributed: bool) -> None:
    if distributed:
        import torch.distributed as dist

        dist.barrier()


def torch_backend() -> bool:
    """Whether Keras runs on the PyTorch backend in this process."""
    import keras

    return keras.backend.backend() == "torch"


def restore_torch_or_explain(model, path: str) -> dict[str, Any]:
    """Restore a DCP step on the torch backend; on another backend (or for
    a step of another format), a `CheckpointError` naming the conversion
    that works."""
    import keras

    if not torch_backend():
        read_torch_info(path)  # a torch step, or a clear error
        raise CheckpointError(
            f"{path} was written by save_checkpoint on the PyTorch backend "
            "(torch.distributed.checkpoint); this process runs Keras on "
            f"{keras.backend.backend()}. Checkpoints do not move across "
            "backends; weights do: save_weights('model.weights.h5') on one "
            "backend and load_weights it on the other (bit-exact both ways)."
        )
    return restore_checkpoint_torch(model, path)
