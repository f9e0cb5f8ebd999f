"""Collectives over `torch.distributed` as autograd functions (gloo or NCCL).

Gradients follow Megatron-LM's convention. The loss is the same on every
rank, and a tensor that a collective makes identical on all ranks (the output
of `all_reduce`, `all_gather`, `broadcast`) is one value, not one copy per
rank: the gradient arriving there is already whole and identical on every
rank, so it is never summed again. A rank-local tensor (a shard, or a partial
sum) gets its own part of the gradient. A replicated tensor that then feeds
rank-local computation must pass through `copy_to_parallel`, whose backward
sums the ranks' partial gradients. `torch.distributed.nn.functional` follows
the other convention (one loss per rank, summed), which is why its
`all_reduce` backward all-reduces and its `broadcast` backward reduces to the
source; under this module's convention both would count the gradient once
per rank.

Every rank must call the same collectives in the same order, with tensors of
the same shape and dtype, and run `backward` too: backward rules that
communicate are collectives as well.

Called through `keras_autoshard.runtime.collectives`, which imports this module only
for torch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from keras_autoshard.runtime.collectives.errors import (
    CollectiveError,
    check_divisible,
    check_op,
    check_src,
    normalize_axis,
)


@dataclass(frozen=True)
class _Group:
    """A process group as the collectives use it: the handle `torch.distributed`
    takes (`None` is WORLD), this process's rank in it and its size."""

    handle: dist.ProcessGroup | None
    rank: int
    size: int
    description: str


def _resolve_group(group: dist.ProcessGroup | None, collective: str) -> _Group:
    if not (dist.is_available() and dist.is_initialized()):
        raise CollectiveError(
            f"{collective}: torch.distributed is not initialized, so there are no "
            "ranks to communicate with. Call "
            "torch.distributed.init_process_group(...) first, or launch the "
            "script with `torchrun --nproc-per-node N script.py` and call "
            "torch.distributed.init_process_group() in it."
        )
    rank = dist.get_rank(group)
    if group is None:
        description = "the default WORLD process group"
    else:
        description = (
            f"the process group of ranks {dist.get_process_group_ranks(group)}"
        )
    if rank < 0:
        raise CollectiveError(
            f"{collective}: this process (global rank {dist.get_rank()}) is not a "
            f"member of {description}. Call a group's collectives only on its "
            "member ranks."
        )
    return _Group(group, rank, dist.get_world_size(group), description)


def _contiguous_copy(x: torch.Tensor) -> torch.Tensor:
    # torch.distributed works in place on dense tensors: never on the input.
    return x.clone(memory_format=torch.contiguous_format)


def _all_reduce_raw(x: torch.Tensor, op: dist.ReduceOp, group: _Group) -> torch.Tensor:
    out = _contiguous_copy(x)
    dist.all_reduce(out, op=op, group=group.handle)
    return out


def _all_gather_raw(x: torch.Tensor, axis: int, group: _Group) -> torch.Tensor:
    piece = x.movedim(axis, 0).contiguous()
    out = piece.new_empty((group.size * piece.shape[0], *piece.shape[1:]))
    dist.all_gather_into_tensor(out, piece, group=group.handle)
    return out.movedim(0, axis)


def _reduce_scatter_raw(x: torch.Tensor, axis: int, group: _Group) -> torch.Tensor:
    full = x.movedim(axis, 0).contiguous()
    out = full.new_empty((full.shape[0] // group.size, *full.shape[1:]))
    dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=group.handle)
    return out.movedim(0, axis)


def _own_slice(x: torch.Tensor, axis: int, group: _Group) -> torch.Tensor:
    chunk = x.shape[axis] // group.size
    return _contiguous_copy(x.narrow(axis, group.rank * chunk, chunk))


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; backward identity (the summed output is one value)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce_raw(x, dist.ReduceOp.SUM, group)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return grad, None


class _AllReduceMax(torch.autograd.Function):
    """Elementwise max over ranks; backward shares the gradient evenly among
    the ranks holding the max, as `torch.amax` and `jnp.max` do for ties."""

    @staticmethod
    def forward(ctx, x, group):
        peak = _all_reduce_raw(x, dist.ReduceOp.MAX, group)
        ctx.save_for_backward(x, peak)
        ctx.group = group
        return peak

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, peak = ctx.saved_tensors
        holds_peak = (x == peak).to(grad.dtype)
        holders = _all_reduce_raw(holds_peak, dist.ReduceOp.SUM, ctx.group)
        return grad * holds_peak / holders, None


class _AllGather(torch.autograd.Function):
    """Concatenate the ranks' pieces; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, axis, group):
        ctx.axis, ctx.group = axis, group
        return _all_gather_raw(x, axis, group)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _own_slice(grad, ctx.axis, ctx.group), None, None


class _ReduceScatterSum(torch.autograd.Function):
    """Sum over ranks, each keeping its slice; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, axis, group):
        ctx.axis, ctx.group = axis, group
        return _reduce_scatter_raw(x, axis, group)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _all_gather_raw(grad, ctx.axis, ctx.group), None, None


class _Scatter(torch.autograd.Function):
    """Keep this rank's slice of a replicated tensor (no communication);
    backward all-gathers, so the replicated input gets its whole gradient."""

    @staticmethod
    def forward(ctx, x, axis, group):
        ctx.axis, ctx.group = axis, group
        return _own_slice(x, axis, group)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _all_gather_raw(grad, ctx.axis, ctx.group), None, None


class _Broadcast(torch.autograd.Function):
    """Every rank gets rank `src`'s tensor; backward (no communication): the
    source keeps the gradient, the other ranks' inputs get zeros."""

    @staticmethod
    def forward(ctx, x, src, group):
        ctx.is_source = group.rank == src
        out = _contiguous_copy(x)
        dist.broadcast(out, group=group.handle, group_src=src)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return (grad if ctx.is_source else torch.zeros_like(grad)), None, None


class _CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce-sum backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _all_reduce_raw(grad, dist.ReduceOp.SUM, ctx.group), None


def all_reduce(
    x: torch.Tensor, op: str, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """See `keras_autoshard.runtime.collectives.all_reduce`."""
    check_op(op, "all_reduce")
    resolved = _resolve_group(group, "all_reduce")
    if op == "max":
        return _AllReduceMax.apply(x, resolved)
    total = _AllReduceSum.apply(x, resolved)
    # gloo has no ReduceOp.AVG; dividing after the sum gives grad / N backward.
    return total / resolved.size if op == "mean" else total


def all_gather(
    x: torch.Tensor, axis: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """See `keras_autoshard.runtime.collectives.all_gather`."""
    axis = normalize_axis(axis, x.ndim, "all_gather")
    return _AllGather.apply(x, axis, _resolve_group(group, "all_gather"))


def reduce_scatter(
    x: torch.Tensor, axis: int, op: str, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """See `keras_autoshard.runtime.collectives.reduce_scatter`."""
    check_op(op, "reduce_scatter")
    axis = normalize_axis(axis, x.ndim, "reduce_scatter")
    resolved = _resolve_group(group, "reduce_scatter")
    check_divisible(
        tuple(x.shape), axis, resolved.size, resolved.description, "reduce_scatter"
    )
    if op == "max":
        return _Scatter.apply(_AllReduceMax.apply(x, resolved), axis, resolved)
    total = _ReduceScatterSum.apply(x, axis, resolved)
    return total / resolved.size if op == "mean" else total


def broadcast(x: torch.Tensor, src: int, group: dist.ProcessGroup | None):
    """See `keras_autoshard.runtime.collectives.broadcast`."""
    resolved = _resolve_group(group, "broadcast")
    check_src(src, resolved.size, resolved.description, "broadcast")
    return _Broadcast.apply(x, src, resolved)


def scatter(x: torch.Tensor, axis: int, group: dist.ProcessGroup | None):
    """See `keras_autoshard.runtime.collectives.scatter`."""
    axis = normalize_axis(axis, x.ndim, "scatter")
    resolved = _resolve_group(group, "scatter")
    check_divisible(
        tuple(x.shape), axis, resolved.size, resolved.description, "scatter"
    )
    return _Scatter.apply(x, axis, resolved)


def copy_to_parallel(x: torch.Tensor, group: dist.ProcessGroup | None):
    """See `keras_autoshard.runtime.collectives.copy_to_parallel`."""
    return _CopyToParallel.apply(x, _resolve_group(group, "copy_to_parallel"))


def reduce_from_parallel(x: torch.Tensor, group: dist.ProcessGroup | None):
    """See `keras_autoshard.runtime.collectives.reduce_from_parallel`."""
    return _AllReduceSum.apply(x, _resolve_group(group, "reduce_from_parallel"))
