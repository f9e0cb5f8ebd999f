"""Collectives on `jax.lax`, run inside `jax.shard_map` over named mesh axes.

Gradients are JAX's own. Under `check_vma=True` (`jax.shard_map`'s default)
JAX types each value as varying over a mesh axis (one value per rank) or
invariant (one value, the same on every rank), and the per-rank transposes it
picks are the PyTorch module's rules:

- `all_reduce` sum (`psum`, varying → invariant): the gradient passes
  unchanged; mean divides it by the group size; max is `_max_over_ranks`.
- `all_gather` (`all_gather(..., to="invarying")` of a varying shard): this
  rank's slice.
- `reduce_scatter` (`psum_scatter`, varying → varying): an all-gather.
- `scatter` (a slice at `axis_index` of an invariant value): the ranks'
  gradients placed side by side and summed, i.e. an all-gather.
- `broadcast` (select at `axis_index`, then `psum`): the source gets the
  gradient, the other ranks zeros.
- `copy_to_parallel` (`pcast` invariant → varying): an all-reduce sum.

JAX computes the right gradient of the whole function even without
`copy_to_parallel`: when an invariant value meets a varying one it inserts
that cast itself. `copy_to_parallel` makes it explicit, so one piece of code is
right on both backends. With `check_vma=False` nothing is typed varying,
`all_gather` is the classic one (transpose: reduce-scatter) and JAX corrects
at the `shard_map` boundary: the gradient of the whole `shard_map`-ed
function is the same, but per-rank `jax.vjp`s inside it follow other rules.

Called through `keras_autoshard.runtime.collectives`, which imports this module only
for JAX arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from keras_autoshard.runtime.collectives.errors import (
    CollectiveError,
    check_divisible,
    check_op,
    check_src,
    normalize_axis,
)

AxisName = str | tuple[str, ...]


def _bound_axes(axis_name: AxisName | None, collective: str) -> tuple[str, ...]:
    """The mesh axes as a tuple, after checking that each is bound here."""
    if axis_name is None:
        raise CollectiveError(
            f"{collective}: a JAX array needs axis_name=, the mesh axis (or tuple "
            "of axes) to communicate over, and the call must run inside "
            "jax.shard_map over a mesh with that axis, e.g. "
            f"jax.shard_map(f, mesh=mesh, in_specs=..., out_specs=...) with "
            f"{collective}(x, axis_name='model') in f."
        )
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if not names or not all(isinstance(name, str) for name in names):
        raise CollectiveError(
            f"{collective}: axis_name={axis_name!r} must be a mesh axis name or a "
            "non-empty tuple of them."
        )
    for name in names:
        try:
            jax.lax.axis_size(name)
        except NameError as error:
            raise CollectiveError(
                f"{collective}: mesh axis {name!r} is not bound here: the call "
                "runs outside jax.shard_map, or inside one whose mesh has no "
                f"axis {name!r}. Call {collective} inside "
                "jax.shard_map(f, mesh=mesh, in_specs=..., out_specs=...) over a "
                f"mesh with an axis named {name!r}, or pass one of that mesh's "
                "axis names."
            ) from error
    return names


def _varying_axes(x: jax.Array) -> frozenset[str]:
    """The mesh axes over which `shard_map` types `x` as one value per rank
    (always none under `check_vma=False`)."""
    return jax.typeof(x).manual_axis_type.varying


def _describe(names: tuple[str, ...]) -> str:
    return f"mesh axis {names[0]!r}" if len(names) == 1 else f"mesh axes {names}"


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _max_over_ranks(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """Elementwise max over the ranks; its derivative is shared evenly among
    the ranks holding the max, as `jnp.max` shares it among tied elements
    (`pmax` itself has no differentiation rule)."""
    return jax.lax.pmax(x, names)


@_max_over_ranks.defjvp
def _max_over_ranks_jvp(names, primals, tangents):
    (x,), (x_dot,) = primals, tangents
    peak = jax.lax.pmax(x, names)
    holds_peak = (x == peak).astype(x_dot.dtype)
    holders = jax.lax.psum(holds_peak, names)
    return peak, jax.lax.psum(x_dot * holds_peak / holders, names)


def _own_slice(x: jax.Array, axis: int, names: tuple[str, ...], size: int):
    chunk = x.shape[axis] // size
    start = jax.lax.axis_index(names) * chunk
    return jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=axis)


def all_reduce(x: jax.Array, op: str, axis_name: AxisName | None) -> jax.Array:
    """See `keras_autoshard.runtime.collectives.all_reduce`."""
    check_op(op, "all_reduce")
    names = _bound_axes(axis_name, "all_reduce")
    if op == "sum":
        return jax.lax.psum(x, names)
    if op == "mean":
        return jax.lax.pmean(x, names)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jax.lax.pmax(x, names)
    return _max_over_ranks(x, names)


def all_gather(x: jax.Array, axis: int, axis_name: AxisName | None) -> jax.Array:
    """See `keras_autoshard.runtime.collectives.all_gather`."""
    axis = normalize_axis(axis, x.ndim, "all_gather")
    names = _bound_axes(axis_name, "all_gather")
    # Under check_vma=True a shard is typed varying, and "invarying" makes the
    # result one value whose transpose keeps this rank's slice, as on the
    # torch side. Untyped (check_vma=False, or a replicated x), the classic
    # gather, whose transpose is a reduce-scatter, is the one shard_map's
    # treatment of the other values expects.
    typed_shard = set(names) <= _varying_axes(x)
    to = "invarying" if typed_shard else "varying"
    return jax.lax.all_gather(x, names, axis=axis, tiled=True, to=to)


def reduce_scatter(
    x: jax.Array, axis: int, op: str, axis_name: AxisName | None
) -> jax.Array:
    """See `keras_autoshard.runtime.collectives.reduce_scatter`."""
    check_op(op, "reduce_scatter")
    axis = normalize_axis(axis, x.ndim, "reduce_scatter")
    names = _bound_axes(axis_name, "reduce_scatter")
    size = jax.lax.axis_size(names)
    check_divisible(x.shape, axis, size, _describe(names), "reduce_scatter")
    if op == "max":
        return _own_slice(all_reduce(x, "max", names), axis, names, size)
    total = jax.lax.psum_scatter(x, names, scatter_dimension=axis, tiled=True)
    return total / size if op == "mean" else total


def broadcast(x: jax.Array, src: int, axis_name: AxisName | None) -> jax.Array:
    """See `keras_autoshard.runtime.collectives.broadcast`."""
    names = _bound_axes(axis_name, "broadcast")
    check_src(src, jax.lax.axis_size(names), _describe(names), "broadcast")
    # jax.lax.pbroadcast has no CPU lowering; selecting then summing is exact.
    is_source = jax.lax.axis_index(names) == src
    return jax.lax.psum(jnp.where(is_source, x, jnp.zeros_like(x)), names)


def scatter(x: jax.Array, axis: int, axis_name: AxisName | None) -> jax.Array:
    """See `keras_autoshard.runtime.collectives.scatter`."""
    axis = normalize_axis(axis, x.ndim, "scatter")
    names = _bound_axes(axis_name, "scatter")
    size = jax.lax.axis_size(names)
    check_divisible(x.shape, axis, size, _describe(names), "scatter")
    return _own_slice(x, axis, names, size)


def copy_to_parallel(x: jax.Array, axis_name: AxisName | None) -> jax.Array:
    """See `keras_autoshard.runtime.collectives.copy_to_parallel`."""
    names = _bound_axes(axis_name, "copy_to_parallel")
    varying = _varying_axes(x)
    invariant = tuple(name for name in names if name not in varying)
    # A value already varying over an axis is per-rank data, not a replicated
    # one: there is nothing to cast, and its gradient must not be summed.
    return jax.lax.pcast(x, invariant, to="varying") if invariant else x


def reduce_from_parallel(x: jax.Array, axis_name: AxisName | None) -> jax.Array:
    """See `keras_autoshard.runtime.collectives.reduce_from_parallel`."""
    return jax.lax.psum(x, _bound_axes(axis_name, "reduce_from_parallel"))
