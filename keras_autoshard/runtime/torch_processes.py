"""The `torch.distributed` process group: found, or started from torchrun's
environment, with a timeout so a dead rank stops the others."""

from __future__ import annotations

import atexit
import datetime
import os

from keras_autoshard.errors import TorchSetupError  # noqa: F401

DEFAULT_TIMEOUT_S = 60


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
    # A group left to interpreter shutdown can abort the process ("terminate
    # called without an active exception" from the backend's threads, seen
    # with gloo), turning a finished job into a failed one: the group this
    # function started is destroyed at exit.
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def device_type() -> str:
    """`"cuda"` when the process group runs NCCL, else `"cpu"`."""
    import torch.distributed as dist

    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def local_batch_rows(global_batch_size: int, mesh, batch_axis: str | None) -> slice:
    """The rows of each global batch this rank feeds (torch ranks fill the
    mesh in row-major order, as `torch_device_mesh` lays them out).

    Args:
        global_batch_size: Rows in one global batch.
        mesh: The plan's `MeshSpec`.
        batch_axis: The mesh axis the batch is split over (`None`: all rows).

    Returns:
        A slice of `range(global_batch_size)`.
    """
    import numpy as np
    import torch.distributed as dist

    if batch_axis is None:
        return slice(0, global_batch_size)
    rank = dist.get_rank() if dist.is_initialized() else 0
    coordinates = np.unravel_index(rank, mesh.shape)
    index = int(coordinates[list(mesh.axis_names).index(batch_axis)])
    ways = mesh.axis_size(batch_axis)
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
