"""The JAX collectives inside `jax.shard_map` (8 simulated devices) match the
unsharded computation, forward and `jax.grad`, and their per-rank gradient
rules are the PyTorch module's (Megatron's convention)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from keras_autoshard.runtime.collectives import (
    CollectiveError,
    all_gather,
    all_reduce,
    broadcast,
    copy_to_parallel,
    reduce_from_parallel,
    reduce_scatter,
    scatter,
)

N = 8
MESH = Mesh(np.array(jax.devices()[:N]), ("model",))
MESH_2X4 = Mesh(np.array(jax.devices()[:N]).reshape(2, 4), ("data", "model"))
RTOL = 1e-5


def seeded(seed: int, *shape: int, ties: bool = False) -> np.ndarray:
    """float32; `ties` draws from {0, 1, 2} so that ranks tie for the max."""
    rng = np.random.default_rng(seed)
    if ties:
        return rng.integers(0, 3, shape).astype(np.float32)
    return rng.standard_normal(shape).astype(np.float32)


def assert_close(actual, expected, what: str) -> None:
    actual, expected = np.asarray(actual, "float64"), np.asarray(expected, "float64")
    assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
    scale = max(np.max(np.abs(expected)), 1e-30)
    error = np.max(np.abs(actual - expected)) / scale
    assert error <= RTOL, f"{what}: relative error {error:.3g} > {RTOL}"


def loss_of(y):
    return jnp.sum(jnp.sin(y) * y)


def value_and_grads(fn, *args, loss=loss_of):
    """`fn(*args)` and the gradient of `loss(fn(*args))` for every argument,
    in one compiled program."""

    def run(*args):
        value, vjp = jax.vjp(fn, *args)
        return value, vjp(jax.grad(loss)(value))

    return jax.jit(run)(*args)


def assert_matches_unsharded(sharded, unsharded, *args, loss=loss_of) -> None:
    """Same value and same gradient of `loss` for every argument."""
    value, grads = value_and_grads(sharded, *args, loss=loss)
    expected_value, expected_grads = value_and_grads(unsharded, *args, loss=loss)
    assert_close(value, expected_value, "forward")
    for index, (actual, expected) in enumerate(zip(grads, expected_grads)):
        assert_close(actual, expected, f"gradient of argument {index}")


def on_mesh(body, in_specs, out_specs, mesh=MESH, check_vma=True):
    return jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
    )


# --- each collective against the unsharded computation ------------------------


@pytest.mark.parametrize(
    "op, reduce",
    [
        ("sum", lambda x: jnp.sum(x, 0, keepdims=True)),
        ("mean", lambda x: jnp.mean(x, 0, keepdims=True)),
        ("max", lambda x: jnp.max(x, 0, keepdims=True)),
    ],
)
@pytest.mark.parametrize("check_vma", [True, False])
def test_all_reduce_matches_unsharded_reduction(op, reduce, check_vma):
    x = seeded(1, N, 3, 4, ties=op == "max")
    sharded = on_mesh(
        lambda x: all_reduce(x, op, axis_name="model"),
        P("model"),
        P(),
        check_vma=check_vma,
    )
    assert_matches_unsharded(sharded, reduce, x)


def test_all_reduce_max_shares_the_gradient_evenly_among_tied_ranks():
    x = np.zeros((N, 2), np.float32)
    x[[1, 4, 6], 0] = 5.0  # three ranks tie for element 0; all tie for element 1
    sharded = on_mesh(
        lambda x: all_reduce(x, "max", axis_name="model"), P("model"), P()
    )
    grad = jax.jit(jax.grad(lambda x: jnp.sum(sharded(x) * jnp.array([3.0, 8.0]))))(x)
    expected = np.zeros((N, 2), np.float32)
    expected[[1, 4, 6], 0] = 1.0
    expected[:, 1] = 1.0
    assert_close(grad, expected, "max gradient")


def test_all_gather_concatenates_in_rank_order_and_matches_unsharded():
    x = seeded(2, 3, 2 * N)
    sharded = on_mesh(
        lambda x: all_gather(x, axis=1, axis_name="model"), P(None, "model"), P()
    )
    assert_matches_unsharded(sharded, lambda x: x, x)


@pytest.mark.parametrize(
    "op, reduce",
    [
        ("sum", lambda x: jnp.sum(x, 0, keepdims=True)),
        ("mean", lambda x: jnp.mean(x, 0, keepdims=True)),
        ("max", lambda x: jnp.max(x, 0, keepdims=True)),
    ],
)
def test_reduce_scatter_matches_unsharded_reduction(op, reduce):
    x = seeded(3, N, 3, 2 * N, ties=op == "max")
    sharded = on_mesh(
        lambda x: reduce_scatter(x, axis=-1, op=op, axis_name="model"),
        P("model"),
        P(None, None, "model"),
    )
    assert_matches_unsharded(sharded, reduce, x)


def test_scatter_keeps_each_ranks_slice_and_gives_the_whole_gradient():
    x = seeded(4, 3, 2 * N)
    sharded = on_mesh(
        lambda x: scatter(x, axis=-1, axis_name="model"), P(), P(None, "model")
    )
    assert_matches_unsharded(sharded, lambda x: x, x)


@pytest.mark.parametrize("src", [0, 5, N - 1])
def test_broadcast_matches_selecting_the_source_rows(src):
    x = seeded(5, N, 3)
    sharded = on_mesh(
        lambda x: broadcast(x, src=src, axis_name="model"), P("model"), P()
    )
    assert_matches_unsharded(sharded, lambda x: x[src : src + 1], x)


# --- the same programs as tests/workers/collectives_torch_worker.py ------------


def megatron_mlp(x, w1, b1, w2, b2):
    h = jax.nn.gelu(copy_to_parallel(x, axis_name="model") @ w1 + b1)
    return reduce_from_parallel(h @ w2, axis_name="model") + b2


def unsharded_mlp(x, w1, b1, w2, b2):
    return jax.nn.gelu(x @ w1 + b1) @ w2 + b2


@pytest.mark.parametrize("check_vma", [True, False])
def test_megatron_mlp_with_f_and_g_matches_unsharded(check_vma):
    args = (
        seeded(10, 4, 8),
        seeded(11, 8, 4 * N),
        seeded(12, 4 * N),
        seeded(13, 4 * N, 8),
        seeded(14, 8),
    )
    in_specs = (P(), P(None, "model"), P("model"), P("model", None), P())
    sharded = on_mesh(megatron_mlp, in_specs, P(), check_vma=check_vma)
    assert_matches_unsharded(sharded, unsharded_mlp, *args)


SOURCE = N - 1


def sequence_parallel_mlp_loss(x, w1, w2, bias_here):
    x_rows = scatter(x, axis=0, axis_name="model")
    gathered = all_gather(x_rows, axis=0, axis_name="model")
    h = jax.nn.gelu(copy_to_parallel(gathered, axis_name="model") @ w1)
    bias = copy_to_parallel(
        broadcast(bias_here, src=SOURCE, axis_name="model"), axis_name="model"
    )
    y_rows = reduce_scatter(h @ w2, axis=0, axis_name="model") + x_rows + bias
    return all_reduce(loss_of(y_rows), axis_name="model")


def unsharded_sequence_parallel_mlp_loss(x, w1, w2, bias_per_rank):
    return loss_of(jax.nn.gelu(x @ w1) @ w2 + x + bias_per_rank[SOURCE])


@pytest.mark.parametrize("check_vma", [True, False])
def test_mlp_with_gather_scatter_broadcast_matches_unsharded(check_vma):
    """Against the unsharded computation in float64: the float32 one is
    itself off by more than `RTOL` on some CPUs (on an AMD EPYC host, XLA:CPU's
    float32 program gives w2's gradient 1.32e-5 from the float64 one, the
    sharded program 3.0e-6, and the two float32 ones differ by 1.37e-5)."""
    args = (seeded(20, 2 * N, 8), seeded(21, 8, 4 * N), seeded(22, 4 * N, 8))
    args += (seeded(23, N, 8),)
    in_specs = (P(), P(None, "model"), P("model", None), P("model"))
    sharded = on_mesh(sequence_parallel_mlp_loss, in_specs, P(), check_vma=check_vma)
    value, grads = value_and_grads(sharded, *args, loss=lambda v: v)
    jax.config.update("jax_enable_x64", True)
    try:
        wide = tuple(np.asarray(a, "float64") for a in args)
        expected_value, expected_grads = value_and_grads(
            unsharded_sequence_parallel_mlp_loss, *wide, loss=lambda v: v
        )
        expected_value = np.asarray(expected_value)
        expected_grads = [np.asarray(g) for g in expected_grads]
    finally:
        jax.config.update("jax_enable_x64", False)
    assert np.asarray(expected_grads[0]).dtype == np.float64
    assert_close(value, expected_value, "forward")
    for index, (actual, expected) in enumerate(zip(grads, expected_grads)):
        assert_close(actual, expected, f"gradient of argument {index}")


# --- per-rank gradient rules: the PyTorch module's backward, rank by rank ------


def per_rank_gradient(collective, x, x_spec, cotangent, cotangent_spec):
    """Each rank's `jax.vjp` of `collective` at its `x` and its cotangent,
    stacked along a new leading axis (rank order)."""

    def body(x, cotangent):
        _, vjp = jax.vjp(collective, x)
        (grad,) = vjp(cotangent)
        return grad[None]

    sharded = on_mesh(body, (x_spec, cotangent_spec), P("model"))
    return jax.jit(sharded)(x, cotangent)


def test_per_rank_rule_all_reduce_sum_passes_the_gradient_unchanged():
    cotangent = seeded(31, 1, 3)
    grads = per_rank_gradient(
        lambda x: all_reduce(x, axis_name="model"),
        seeded(30, N, 3),
        P("model"),
        cotangent,
        P(),
    )
    assert_close(grads, np.broadcast_to(cotangent, (N, 1, 3)), "per-rank gradient")


def test_per_rank_rule_all_reduce_mean_divides_by_the_group_size():
    cotangent = seeded(31, 1, 3)
    grads = per_rank_gradient(
        lambda x: all_reduce(x, "mean", axis_name="model"),
        seeded(30, N, 3),
        P("model"),
        cotangent,
        P(),
    )
    expected = np.broadcast_to(cotangent / N, (N, 1, 3))
    assert_close(grads, expected, "per-rank gradient")


def test_per_rank_rule_all_gather_keeps_this_ranks_slice():
    cotangent = seeded(32, 2 * N, 3)
    grads = per_rank_gradient(
        lambda x: all_gather(x, axis_name="model"),
        seeded(33, 2 * N, 3),
        P("model"),
        cotangent,
        P(),
    )
    assert_close(grads, cotangent.reshape(N, 2, 3), "per-rank gradient")


def test_per_rank_rule_reduce_scatter_all_gathers_the_gradient():
    cotangent = seeded(34, N, 3)
    grads = per_rank_gradient(
        lambda x: reduce_scatter(x, axis_name="model"),
        seeded(35, N * N, 3),
        P("model"),
        cotangent,
        P("model"),
    )
    assert_close(grads, np.broadcast_to(cotangent, (N, N, 3)), "per-rank gradient")


def test_per_rank_rule_scatter_all_gathers_the_gradient():
    cotangent = seeded(36, N, 3)
    grads = per_rank_gradient(
        lambda x: scatter(x, axis_name="model"),
        seeded(37, N, 3),
        P(),
        cotangent,
        P("model"),
    )
    assert_close(grads, np.broadcast_to(cotangent, (N, N, 3)), "per-rank gradient")


def test_per_rank_rule_broadcast_gives_the_gradient_to_the_source_only():
    cotangent = seeded(38, 1, 3)
    grads = per_rank_gradient(
        lambda x: broadcast(x, src=2, axis_name="model"),
        seeded(39, N, 3),
        P("model"),
        cotangent,
        P(),
    )
    expected = np.zeros((N, 1, 3), np.float32)
    expected[2] = cotangent
    assert_close(grads, expected, "per-rank gradient")


def test_per_rank_rule_copy_to_parallel_sums_the_gradient_over_ranks():
    cotangent = seeded(40, N, 3)
    grads = per_rank_gradient(
        lambda x: copy_to_parallel(x, axis_name="model"),
        seeded(41, 1, 3),
        P(),
        cotangent,
        P("model"),
    )
    expected = np.broadcast_to(cotangent.sum(0, keepdims=True), (N, 1, 3))
    assert_close(grads, expected, "per-rank gradient")


def test_per_rank_rule_reduce_from_parallel_passes_the_gradient_unchanged():
    cotangent = seeded(42, 1, 3)
    grads = per_rank_gradient(
        lambda x: reduce_from_parallel(x, axis_name="model"),
        seeded(43, N, 3),
        P("model"),
        cotangent,
        P(),
    )
    assert_close(grads, np.broadcast_to(cotangent, (N, 1, 3)), "per-rank gradient")


# --- tuples of axes and sub-axes of a (2, 4) mesh ------------------------------


def test_all_reduce_over_one_axis_of_a_2x4_mesh_reduces_within_each_group():
    x = seeded(50, 2, 4, 3)
    sharded = on_mesh(
        lambda x: all_reduce(x, axis_name="model"),
        P("data", "model"),
        P("data"),
        mesh=MESH_2X4,
    )
    assert_matches_unsharded(sharded, lambda x: jnp.sum(x, 1, keepdims=True), x)


def test_all_gather_over_an_axis_tuple_concatenates_row_major():
    x = seeded(51, 2 * N, 3)
    sharded = on_mesh(
        lambda x: all_gather(x, axis_name=("data", "model")),
        P(("data", "model")),
        P(),
        mesh=MESH_2X4,
    )
    assert_matches_unsharded(sharded, lambda x: x, x)


def test_reduce_scatter_over_an_axis_tuple_matches_unsharded():
    x = seeded(52, N, 2 * N, 3)
    sharded = on_mesh(
        lambda x: reduce_scatter(x[0], axis_name=("data", "model")),
        P(("data", "model")),
        P(("data", "model")),
        mesh=MESH_2X4,
    )
    assert_matches_unsharded(sharded, lambda x: jnp.sum(x, 0), x)


def test_broadcast_over_an_axis_tuple_takes_the_row_major_source():
    x = seeded(53, N, 3)
    sharded = on_mesh(
        lambda x: broadcast(x, src=6, axis_name=("data", "model")),
        P(("data", "model")),
        P(),
        mesh=MESH_2X4,
    )
    assert_matches_unsharded(sharded, lambda x: x[6:7], x)


def test_scatter_over_the_model_axis_of_a_2x4_mesh_matches_unsharded():
    x = seeded(54, 2, 3, 8)
    sharded = on_mesh(
        lambda x: scatter(x, axis=-1, axis_name="model"),
        P("data"),
        P("data", None, "model"),
        mesh=MESH_2X4,
    )
    assert_matches_unsharded(sharded, lambda x: x, x)


def test_megatron_mlp_on_model_axis_with_batch_on_data_axis_matches_unsharded():
    args = (
        seeded(60, 4, 8),
        seeded(61, 8, 16),
        seeded(62, 16),
        seeded(63, 16, 8),
        seeded(64, 8),
    )
    in_specs = (P("data"), P(None, "model"), P("model"), P("model", None), P())
    sharded = on_mesh(megatron_mlp, in_specs, P("data"), mesh=MESH_2X4)
    assert_matches_unsharded(sharded, unsharded_mlp, *args)


# --- errors -------------------------------------------------------------------

PUBLIC_CALLS = {
    "all_reduce": lambda x, **k: all_reduce(x, **k),
    "all_gather": lambda x, **k: all_gather(x, **k),
    "reduce_scatter": lambda x, **k: reduce_scatter(x, **k),
    "broadcast": lambda x, **k: broadcast(x, **k),
    "scatter": lambda x, **k: scatter(x, **k),
    "copy_to_parallel": lambda x, **k: copy_to_parallel(x, **k),
    "reduce_from_parallel": lambda x, **k: reduce_from_parallel(x, **k),
}


@pytest.mark.parametrize("name", PUBLIC_CALLS)
def test_outside_shard_map_raises_naming_the_axis(name):
    with pytest.raises(CollectiveError) as raised:
        PUBLIC_CALLS[name](jnp.ones((N, 2)), axis_name="model")
    message = str(raised.value)
    assert message.startswith(name)
    assert "'model'" in message and "jax.shard_map" in message


@pytest.mark.parametrize("name", PUBLIC_CALLS)
def test_without_axis_name_raises(name):
    with pytest.raises(CollectiveError, match="needs axis_name="):
        PUBLIC_CALLS[name](jnp.ones((N, 2)))


def test_axis_not_in_the_enclosing_mesh_raises_naming_it():
    sharded = on_mesh(lambda x: all_reduce(x, axis_name="data"), P("model"), P())
    with pytest.raises(CollectiveError, match="mesh axis 'data' is not bound"):
        sharded(jnp.ones((N, 2)))


def test_one_unbound_axis_in_a_tuple_raises_naming_it():
    sharded = on_mesh(
        lambda x: all_gather(x, axis_name=("model", "expert")), P("model"), P()
    )
    with pytest.raises(CollectiveError, match="mesh axis 'expert' is not bound"):
        sharded(jnp.ones((N, 2)))


@pytest.mark.parametrize(
    "call",
    [
        lambda x: all_reduce(x, "min", axis_name="model"),
        lambda x: reduce_scatter(x, op="prod", axis_name="model"),
    ],
    ids=["all_reduce", "reduce_scatter"],
)
def test_unknown_op_raises(call):
    sharded = on_mesh(call, P(), P())
    with pytest.raises(CollectiveError, match="unknown reduction op="):
        sharded(jnp.ones((N, 2)))


@pytest.mark.parametrize("name", ["reduce_scatter", "scatter"])
def test_dimension_not_divisible_by_the_axis_size_raises_with_sizes(name):
    sharded = on_mesh(lambda x: PUBLIC_CALLS[name](x, axis_name="model"), P(), P())
    with pytest.raises(CollectiveError) as raised:
        sharded(jnp.ones((N + 2, 2)))
    message = str(raised.value)
    for part in ("dimension 0", f"size {N + 2}", f"{N} ranks", "'model'"):
        assert part in message


@pytest.mark.parametrize("src", [-1, N])
def test_broadcast_source_out_of_range_raises(src):
    sharded = on_mesh(lambda x: broadcast(x, src=src, axis_name="model"), P(), P())
    with pytest.raises(CollectiveError, match=f"src={src} is not a rank"):
        sharded(jnp.ones((2,)))


def test_axis_out_of_range_raises():
    sharded = on_mesh(lambda x: all_gather(x, axis=2, axis_name="model"), P(), P())
    with pytest.raises(CollectiveError, match="axis=2 is out of range"):
        sharded(jnp.ones((N, 2)))


def test_torch_group_argument_with_a_jax_array_raises():
    with pytest.raises(CollectiveError, match="Pass axis_name="):
        all_reduce(jnp.ones(2), group=object())
