"""Every PyTorch private the package relies on, each behind one named function.

Checked on torch 2.13 to 2.15. PyTorch is imported inside the functions,
never at import time. `missing_privates()` checks that the installed PyTorch
still has every private used here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keras_autoshard.compat.checks import failing


def forget_mesh_process_groups(device_mesh: Any) -> bool:
    """Drop a torch `DeviceMesh`'s own references to its process groups.

    A `DeviceMesh` keeps each of its groups in `DeviceMesh._pg_registry` (a
    dict, group name to group), so `destroy_process_group()` alone leaves
    them, and gloo's worker threads, alive through interpreter shutdown
    (see `runtime.torch_processes.end_groups_at_exit`). If the attribute
    changes, nothing is dropped and a finished torchrun job can again end
    with "terminate called without an active exception".

    Args:
        device_mesh: A `torch.distributed.device_mesh.DeviceMesh`, or `None`
            (a mesh already collected).

    Returns:
        Whether a registry was found and cleared.
    """
    registry = getattr(device_mesh, "_pg_registry", None)
    if not isinstance(registry, dict):
        return False
    registry.clear()
    return True


def missing_privates() -> list[str]:
    """The PyTorch privates above that the installed PyTorch lacks. Imports
    PyTorch (a one-device gloo group in this process, ended again).

    Returns:
        One readable name per missing private (empty when all are there).

    Example:

    ```python
    from keras_autoshard.compat import torch_private
    assert torch_private.missing_privates() == []
    ```
    """
    return failing(_CHECKS)


def _mesh_keeps_a_group_registry() -> bool:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("x",))
        registry = getattr(mesh, "_pg_registry", None)
        return isinstance(registry, dict) and len(registry) > 0
    finally:
        if started:
            dist.destroy_process_group()


_CHECKS: list[tuple[str, Callable[[], bool]]] = [
    (
        "torch.distributed.device_mesh.DeviceMesh._pg_registry",
        _mesh_keeps_a_group_registry,
    ),
]
