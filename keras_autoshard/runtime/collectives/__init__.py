"""Collectives that run on JAX arrays and on PyTorch tensors alike.

Each function looks at its tensor: a `torch.Tensor` goes to
`torch_collectives.py` (autograd functions over `torch.distributed`, gloo or
NCCL; `group=None` is the default WORLD group), a JAX array or tracer to
`jax_collectives.py` (`jax.lax` collectives, inside `jax.shard_map` over the
mesh axis or axes `axis_name`). Neither backend is imported before a tensor
of its kind arrives.

Gradients follow Megatron-LM's convention on both backends: the loss is the
same on every rank, and a tensor that a collective makes identical on all
ranks is one value, whose gradient is whole on every rank. A replicated
tensor that feeds rank-local computation (a column-parallel matmul) passes
through `copy_to_parallel`, and partial results leave it through
`reduce_from_parallel`. On JAX, where `shard_map` tracks which values are
replicated, JAX's own differentiation gives these rules (see
`jax_collectives.py`).

Ranks are ordered by their index in the group: the rank of the process group
on torch, `jax.lax.axis_index(axis_name)` on JAX (row-major over a tuple of
axes). `all_gather` concatenates in that order and `scatter` and
`reduce_scatter` hand out slices in it.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, TypeVar

from keras_autoshard.runtime.collectives.errors import CollectiveError

__all__ = [
    "CollectiveError",
    "all_gather",
    "all_reduce",
    "broadcast",
    "copy_to_parallel",
    "reduce_from_parallel",
    "reduce_scatter",
    "scatter",
]

Tensor = TypeVar("Tensor")


def _backend_for(
    x: Any, axis_name: Any, group: Any, collective: str
) -> tuple[ModuleType, Any]:
    """The backend module for `x` and the group argument it takes."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if axis_name is not None:
            raise CollectiveError(
                f"{collective}: axis_name={axis_name!r} names a JAX mesh axis, but "
                "x is a torch.Tensor. Pass group= (a torch.distributed "
                "ProcessGroup, or None for the default WORLD group) instead."
            )
        module = "keras_autoshard.runtime.collectives.torch_collectives"
        return importlib.import_module(module), group
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        if group is not None:
            raise CollectiveError(
                f"{collective}: group= is a torch.distributed ProcessGroup, but x "
                "is a JAX array. Pass axis_name= (the mesh axis, or tuple of "
                "axes, of the enclosing jax.shard_map) instead."
            )
        module = "keras_autoshard.runtime.collectives.jax_collectives"
        return importlib.import_module(module), axis_name
    raise CollectiveError(
        f"{collective}: x must be a torch.Tensor or a JAX array, got "
        f"{type(x).__module__}.{type(x).__qualname__}. Convert it first, e.g. "
        "with torch.as_tensor(x) or jax.numpy.asarray(x)."
    )


def all_reduce(
    x: Tensor,
    op: str = "sum",
    *,
    axis_name: str | tuple[str, ...] | None = None,
    group: Any = None,
) -> Tensor:
    """Reduce `x` elementwise over the ranks; every rank gets the result.

    Gradient: `"sum"` passes it unchanged (the result is one value, its
    gradient already whole on every rank); `"mean"` divides it by the group
    size; `"max"` sends it to the ranks whose element is the maximum, shared
    evenly among tied ranks (as `torch.amax` and `jnp.max` share it among
    tied elements), and zeros elsewhere. Integer `"max"` has no gradient.

    Args:
        x: This rank's tensor; the same shape and dtype on every rank.
        op: `"sum"`, `"mean"` or `"max"`.
        axis_name: JAX only: the mesh axis, or tuple of axes, to reduce over.
        group: PyTorch only: the process group; `None` is WORLD.

    Returns:
        The reduced tensor, the same on every rank, shaped like `x`.

    Raises:
        CollectiveError: an unknown `op`, or no group to run in (JAX: no
            `axis_name`, or it is not bound by an enclosing `jax.shard_map`;
            PyTorch: `torch.distributed` is not initialized).

    Example:

    ```python
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    total = jax.shard_map(
        lambda x: all_reduce(x, axis_name="model"),
        mesh=mesh, in_specs=P("model"), out_specs=P(),
    )
    total(np.array([[1.0, 2.0], [10.0, 20.0]]))  # [[11., 22.]]
    ```
    """
    backend, where = _backend_for(x, axis_name, group, "all_reduce")
    return backend.all_reduce(x, op, where)


def all_gather(
    x: Tensor,
    *,
    axis: int = 0,
    axis_name: str | tuple[str, ...] | None = None,
    group: Any = None,
) -> Tensor:
    """Concatenate the ranks' tensors along `axis`, in rank order.

    Gradient: each rank keeps its own slice of the (whole, replicated)
    gradient of the result.

    Args:
        x: This rank's piece; the same shape and dtype on every rank.
        axis: The dimension to concatenate along.
        axis_name: JAX only: the mesh axis, or tuple of axes, to gather over.
        group: PyTorch only: the process group; `None` is WORLD.

    Returns:
        The gathered tensor, the same on every rank: `x.shape` with
        dimension `axis` multiplied by the group size.

    Raises:
        CollectiveError: `axis` out of range, or no group to run in.

    Example:

    ```python
    # torchrun --nproc-per-node 2 script.py, after init_process_group():
    rank = torch.distributed.get_rank()
    all_gather(torch.full((1, 2), float(rank)))  # [[0., 0.], [1., 1.]]
    ```
    """
    backend, where = _backend_for(x, axis_name, group, "all_gather")
    return backend.all_gather(x, axis, where)


def reduce_scatter(
    x: Tensor,
    *,
    axis: int = 0,
    op: str = "sum",
    axis_name: str | tuple[str, ...] | None = None,
    group: Any = None,
) -> Tensor:
    """Reduce `x` over the ranks; rank `r` keeps the `r`-th slice along `axis`.

    Gradient: the ranks' gradients of their slices, gathered along `axis`
    (divided by the group size for `"mean"`; for `"max"`, routed as in
    `all_reduce`).

    Args:
        x: This rank's tensor; the same shape and dtype on every rank, with
            dimension `axis` divisible by the group size.
        axis: The dimension to split.
        op: `"sum"`, `"mean"` or `"max"`.
        axis_name: JAX only: the mesh axis, or tuple of axes, to reduce over.
        group: PyTorch only: the process group; `None` is WORLD.

    Returns:
        This rank's slice of the reduced tensor: `x.shape` with dimension
        `axis` divided by the group size.

    Raises:
        CollectiveError: an unknown `op`, `axis` out of range, dimension
            `axis` not divisible by the group size, or no group to run in.

    Example:

    ```python
    # torchrun --nproc-per-node 2 script.py, after init_process_group():
    reduce_scatter(torch.tensor([1.0, 2.0]))  # rank 0: [2.], rank 1: [4.]
    ```
    """
    backend, where = _backend_for(x, axis_name, group, "reduce_scatter")
    return backend.reduce_scatter(x, axis, op, where)


def broadcast(
    x: Tensor,
    *,
    src: int = 0,
    axis_name: str | tuple[str, ...] | None = None,
    group: Any = None,
) -> Tensor:
    """Every rank gets rank `src`'s `x`.

    Gradient: rank `src` gets the gradient of the result, the other ranks
    zeros, with no communication. The result is one value whose gradient is
    already whole on every rank, so summing it onto `src` (as
    `torch.distributed.nn.functional.broadcast` does, for one loss per rank)
    would count it once per rank. If `x` is itself replicated and feeds the
    loss other ways too, pass it through `copy_to_parallel` first.

    Args:
        x: This rank's tensor; the same shape and dtype on every rank (only
            rank `src`'s values matter).
        src: The source rank's index in the group.
        axis_name: JAX only: the mesh axis, or tuple of axes, to broadcast
            over (`src` is then the row-major index over the tuple).
        group: PyTorch only: the process group; `None` is WORLD.

    Returns:
        Rank `src`'s tensor, on every rank.

    Raises:
        CollectiveError: `src` is not a rank of the group, or no group to run
            in.

    Example:

    ```python
    # torchrun --nproc-per-node 2 script.py, after init_process_group():
    rank = torch.distributed.get_rank()
    broadcast(torch.tensor([float(rank)]), src=1)  # [1.] on both ranks
    ```
    """
    backend, where = _backend_for(x, axis_name, group, "broadcast")
    return backend.broadcast(x, src, where)


def scatter(
    x: Tensor,
    *,
    axis: int = 0,
    axis_name: str | tuple[str, ...] | None = None,
    group: Any = None,
) -> Tensor:
    """Rank `r` keeps the `r`-th slice of the replicated `x` along `axis`.

    No communication forward. Gradient: the ranks' gradients of their
    slices, gathered along `axis`, so the replicated `x` gets its whole
    gradient on every rank.

    Args:
        x: The same tensor on every rank, dimension `axis` divisible by the
            group size.
        axis: The dimension to split.
        axis_name: JAX only: the mesh axis, or tuple of axes, to split over.
        group: PyTorch only: the process group; `None` is WORLD.

    Returns:
        This rank's slice: `x.shape` with dimension `axis` divided by the
        group size.

    Raises:
        CollectiveError: `axis` out of range, dimension `axis` not divisible
            by the group size, or no group to run in.

    Example:

    ```python
    # torchrun --nproc-per-node 2 script.py, after init_process_group():
    scatter(torch.tensor([1.0, 2.0, 3.0, 4.0]))  # rank 0: [1., 2.], rank 1: [3., 4.]
    ```
    """
    backend, where = _backend_for(x, axis_name, group, "scatter")
    return backend.scatter(x, axis, where)


def copy_to_parallel(
    x: Tensor,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    group: Any = None,
) -> Tensor:
    """Megatron's `f`: enter a parallel region with a replicated tensor.

    Identity forward. Gradient: the sum over ranks of the gradients of the
    result, since each rank's rank-local computation (a column-parallel
    matmul) contributes only part of the replicated input's gradient.

    Args:
        x: The same tensor on every rank.
        axis_name: JAX only: the mesh axis, or tuple of axes, of the parallel
            region. (JAX casts `x` to varying over them, whose transpose is
            the sum; an `x` already varying there is returned as it is.)
        group: PyTorch only: the process group; `None` is WORLD.

    Returns:
        `x`.

    Raises:
        CollectiveError: no group to run in.

    Example:

    ```python
    # Column-parallel then row-parallel MLP, w1 split by columns, w2 by rows.
    h = gelu(copy_to_parallel(x, axis_name="model") @ w1_shard)
    y = reduce_from_parallel(h @ w2_shard, axis_name="model")
    ```
    """
    backend, where = _backend_for(x, axis_name, group, "copy_to_parallel")
    return backend.copy_to_parallel(x, where)


def reduce_from_parallel(
    x: Tensor,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    group: Any = None,
) -> Tensor:
    """Megatron's `g`: leave a parallel region by summing the ranks' partials.

    The same as `all_reduce(x, "sum")`: all-reduce sum forward, and the
    gradient passes unchanged.

    Args:
        x: This rank's partial result.
        axis_name: JAX only: the mesh axis, or tuple of axes, to sum over.
        group: PyTorch only: the process group; `None` is WORLD.

    Returns:
        The sum over ranks, the same on every rank.

    Raises:
        CollectiveError: no group to run in.

    Example:

    ```python
    y = reduce_from_parallel(h @ w2_shard, axis_name="model")
    ```
    """
    backend, where = _backend_for(x, axis_name, group, "reduce_from_parallel")
    return backend.reduce_from_parallel(x, where)
