"""The `torch.distributed` process group: found, or started from torchrun's
environment, with a timeout so a dead rank stops the others."""

from __future__ import annotations

import atexit
import datetime
import os
import weakref

from keras_autoshard.compat import torch_private
from keras_autoshard.errors import TorchSetupError  # noqa: F401
from keras_autoshard.plans.mesh import SpecEntry, entry_axes

DEFAULT_TIMEOUT_S = 60

# What `_end_process_groups` undoes at exit: whether `ensure_process_group`
# started the default group, and (weakly) the device meshes the library made.
_started_here = False
_meshes: list[weakref.ref] = []
_cleanup_registered = False


def ensure_process_group(
    backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Make sure a default process group exists.

    Under `torchrun` (the `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and
    `MASTER_PORT` variables set) this starts one: NCCL when CUDA is available,
    gloo otherwise. A collective that waits longer than `timeout_s` for a
    peer (a dead rank) raises instead of hanging.

    Args:
        backend: `"gloo"`, `"nccl"` or `None` for the default of the machine.
        timeout_s: Seconds a collective may wait for the other ranks.

    Raises:
        TorchSetupError: no process group and no torchrun environment.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise TorchSetupError("This PyTorch build has no torch.distributed.")
    if dist.is_initialized():
        return
    missing = [
        name
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if name not in os.environ
    ]
    if missing:
        raise TorchSetupError(
            "No torch.distributed process group, and the torchrun variables "
            f"{missing} are not set. Launch the script with "
            "`torchrun --nproc-per-node N script.py` (or `python -m "
            "torch.distributed.run ...`), or call "
            "torch.distributed.init_process_group() first."
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    global _started_here
    _started_here = True
    _register_exit_cleanup()


def end_groups_at_exit(device_mesh) -> None:
    """Have the process groups of `device_mesh` end before the interpreter.

    A torch `DeviceMesh` keeps a reference to each of its process groups,
    and the model's DTensors (and DTensor's sharding cache) keep the mesh,
    so `destroy_process_group()` alone leaves the groups, and gloo's worker
    threads, alive through interpreter shutdown. A worker thread that then
    frees the last tensor of a finished collective needs the GIL, Python
    ends that thread, and the process aborts ("terminate called without an
    active exception") after the script has returned. At exit the library
    therefore drops the mesh's references too; the groups' destructors then
    join their threads while the interpreter is still whole.

    The references are dropped through a torch private
    (`compat.torch_private.forget_mesh_process_groups`).

    Args:
        device_mesh: A `torch.distributed.device_mesh.DeviceMesh` the
            library created.
    """
    _meshes.append(weakref.ref(device_mesh))
    _register_exit_cleanup()


def _register_exit_cleanup() -> None:
    global _cleanup_registered
    if not _cleanup_registered:
        atexit.register(_end_process_groups)
        _cleanup_registered = True


def _end_process_groups() -> None:
    """Destroy the default group if `ensure_process_group` started it and
    drop the library's meshes' references to their groups (see
    `end_groups_at_exit`)."""
    import torch.distributed as dist

    if _started_here and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for reference in _meshes:
        torch_private.forget_mesh_process_groups(reference())
    _meshes.clear()


def device_type() -> str:
    """`"cuda"` when the process group runs NCCL, else `"cpu"`."""
    import torch.distributed as dist

    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def local_batch_rows(global_batch_size: int, mesh, batch_axis: SpecEntry) -> slice:
    """The rows of each global batch this rank feeds (torch ranks fill the
    mesh in row-major order, as `torch_device_mesh` lays them out).

    Args:
        global_batch_size: Rows in one global batch.
        mesh: The plan's `MeshSpec`.
        batch_axis: The mesh axis (or tuple of axes, the first major) the
            batch is split over (`None`: all rows).

    Returns:
        A slice of `range(global_batch_size)`.
    """
    import numpy as np
    import torch.distributed as dist

    axes = entry_axes(batch_axis)
    if not axes:
        return slice(0, global_batch_size)
    rank = dist.get_rank() if dist.is_initialized() else 0
    coordinates = np.unravel_index(rank, mesh.shape)
    # The batch position: the batch axes' coordinates, the first axis major.
    index = int(
        np.ravel_multi_index(
            [coordinates[list(mesh.axis_names).index(axis)] for axis in axes],
            [mesh.axis_size(axis) for axis in axes],
        )
    )
    ways = mesh.axis_size(axes)
    if global_batch_size % ways:
        raise TorchSetupError(
            f"Global batch {global_batch_size} cannot be cut into {ways} equal "
            f"parts over mesh axis {batch_axis!r}. Use a multiple of {ways}."
        )
    rows = global_batch_size // ways
    return slice(index * rows, (index + 1) * rows)


def failed_on_any_rank(failed: bool) -> bool:
    """Whether any rank failed (a collective: every rank must call it)."""
    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
