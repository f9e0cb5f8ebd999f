"""Tests for `keras_autoshard.report.hlo.collectives`.

Real programs are compiled for 8 simulated CPU devices and their collectives
are checked against numbers derived by hand from the shapes; hand-written HLO
snippets cover each replica-group syntax and the printing variants (async
pairs, tuple operands, operands without inline shapes).
"""

import os

# tests/conftest.py normally does this; kept so the module also runs alone.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import collections  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from keras_autoshard.report.hlo.collectives import (  # noqa: E402
    CollectiveOp,
    parse_collectives,
    summarize_collectives,
)

AXES = ("batch", "model")
F32 = 4


# ---------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
    assert jax.device_count() >= 8, "these tests need 8 simulated devices"


def _mesh(shape, names=AXES, order=None):
    devices = np.array(jax.devices()[:8])
    if order is not None:
        devices = devices[list(order)]
    return Mesh(devices.reshape(shape), names)


def _placed(mesh, shape, spec):
    array = jnp.arange(math.prod(shape), dtype=jnp.float32).reshape(shape)
    return jax.device_put(array, NamedSharding(mesh, spec))


def _compiled_text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def _axis_groups(mesh_shape, axis_indices):
    """Device groups spanning `axis_indices`, derived with numpy moveaxis."""
    ids = np.arange(math.prod(mesh_shape)).reshape(mesh_shape)
    moved = np.moveaxis(ids, axis_indices, range(-len(axis_indices), 0))
    group_size = math.prod(mesh_shape[i] for i in axis_indices)
    return {frozenset(row) for row in moved.reshape(-1, group_size).tolist()}


def _as_sets(groups):
    return {frozenset(group) for group in groups}


def _by_kind(ops):
    counts = collections.Counter(op.kind for op in ops)
    assert all(count == 1 for count in counts.values()), counts
    return {op.kind: op for op in ops}


_REDUCER = """%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}
"""


def _hlo(*lines, header="num_partitions=8", params="p0: f32[8,16]"):
    """A one-computation HLO module around the given instruction lines."""
    body = "\n".join(f"  {line}" for line in lines)
    return (
        f"HloModule test, is_scheduled=true, {header}\n\n{_REDUCER}\n"
        f"ENTRY %main ({params}) -> f32[8,16] {{\n{body}\n}}\n"
    )


def _all_reduce_with_groups(groups_text, header="num_partitions=8"):
    return _hlo(
        "%p0 = f32[8,16]{1,0} parameter(0)",
        f"ROOT %all-reduce.7 = f32[8,16]{{1,0}} all-reduce(%p0), channel_id=1, "
        f"replica_groups={groups_text}, use_global_device_ids=true, to_apply=%add",
        header=header,
    )


# ---------------------------------------------------------------------------
# Compiled programs.
# ---------------------------------------------------------------------------


def _mlp(x, w1, w2):
    return jnp.tanh(x @ w1) @ w2


def _mlp_args(mesh):
    x = _placed(mesh, (16, 32), P("batch", None))
    w1 = _placed(mesh, (32, 64), P(None, "model"))
    w2 = _placed(mesh, (64, 16), P("model", None))
    return x, w1, w2


def test_mlp_forward_has_one_all_reduce_over_model():
    mesh = _mesh((2, 4))
    text = _compiled_text(_mlp, *_mlp_args(mesh))

    ops = parse_collectives(text, (2, 4), AXES)

    assert len(ops) == 1
    (op,) = ops
    assert op.kind == "all-reduce"
    assert op.mesh_axes == ("model",)
    # Per device the output block is (16 / 2) x 16 partial sums.
    assert op.operand_bytes == 8 * 16 * F32
    assert op.result_bytes == 8 * 16 * F32
    assert op.operand_shapes == ("f32[8,16]",)
    assert _as_sets(op.replica_groups) == _axis_groups((2, 4), [1])
    assert op.is_async is False


def test_mesh_shape_mapping_is_accepted():
    mesh = _mesh((2, 4))
    text = _compiled_text(_mlp, *_mlp_args(mesh))

    ops = parse_collectives(text, mesh.shape, mesh.axis_names)

    assert [(op.kind, op.mesh_axes) for op in ops] == [("all-reduce", ("model",))]


def test_mlp_gradient_all_reduces_per_axis():
    mesh = _mesh((2, 4))
    x, w1, w2 = _mlp_args(mesh)

    def loss(w1, w2, x):
        return jnp.sum(_mlp(x, w1, w2) ** 2)

    text = _compiled_text(jax.grad(loss, argnums=(0, 1)), w1, w2, x)
    summary = summarize_collectives(parse_collectives(text, (2, 4), AXES))

    # Forward: the (8, 16) partial output over "model". Backward: the
    # per-device weight gradients, (32, 16) for w1 and (16, 16) for w2,
    # summed over "batch" in one combined all-reduce.
    gradient_bytes = (32 * 16 + 16 * 16) * F32
    assert summary == [
        {
            "kind": "all-reduce",
            "mesh_axes": ["batch"],
            "count": 1,
            "operand_bytes": gradient_bytes,
            "result_bytes": gradient_bytes,
            # Ring all-reduce over 2 devices: 2 (2 - 1) / 2 of the bytes.
            "ring_bytes": float(gradient_bytes),
        },
        {
            "kind": "all-reduce",
            "mesh_axes": ["model"],
            "count": 1,
            "operand_bytes": 8 * 16 * F32,
            "result_bytes": 8 * 16 * F32,
            "ring_bytes": 2 * 3 / 4 * 8 * 16 * F32,
        },
    ]


def test_sharding_constraint_to_replicated_all_gathers_over_batch():
    mesh = _mesh((2, 4))
    x = _placed(mesh, (16, 32), P("batch", None))

    def gather(x):
        replicated = NamedSharding(mesh, P())
        return jax.lax.with_sharding_constraint(x * 2.0, replicated) * 3.0

    ops = parse_collectives(_compiled_text(gather, x), (2, 4), AXES)

    assert len(ops) == 1
    (op,) = ops
    assert op.kind == "all-gather"
    assert op.mesh_axes == ("batch",)
    assert op.operand_bytes == 8 * 32 * F32
    assert op.result_bytes == 16 * 32 * F32
    assert op.result_shapes == ("f32[16,32]",)
    assert _as_sets(op.replica_groups) == _axis_groups((2, 4), [0])


@pytest.mark.parametrize(
    "mesh_shape, expected_axes",
    [
        ((2, 4), ("batch", "model")),
        ((1, 8), ("model",)),
        ((8, 1), ("batch",)),
        ((4, 2), ("batch", "model")),
    ],
)
def test_sum_over_flattened_axes_is_one_all_reduce(mesh_shape, expected_axes):
    mesh = _mesh(mesh_shape)
    x = _placed(mesh, (16, 32), P(("batch", "model")))

    ops = parse_collectives(_compiled_text(jnp.sum, x), mesh_shape, AXES)

    assert [(op.kind, op.mesh_axes) for op in ops] == [("all-reduce", expected_axes)]
    assert ops[0].operand_bytes == F32
    assert ops[0].replica_groups == (tuple(range(8)),)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
def test_sum_over_both_axes_reduces_axis_by_axis(mesh_shape):
    mesh = _mesh(mesh_shape)
    x = _placed(mesh, (16, 32), P("batch", "model"))

    ops = parse_collectives(_compiled_text(jnp.sum, x), mesh_shape, AXES)

    assert [(op.kind, op.mesh_axes, op.operand_bytes) for op in ops] == [
        ("all-reduce", ("model",), F32),
        ("all-reduce", ("batch",), F32),
    ]
    assert _as_sets(ops[0].replica_groups) == _axis_groups(mesh_shape, [1])
    assert _as_sets(ops[1].replica_groups) == _axis_groups(mesh_shape, [0])


def test_mesh_replica_groups_with_device_order_on_3d_mesh():
    mesh = _mesh((2, 2, 2), names=("a", "b", "c"))
    x = _placed(mesh, (16, 32), P(("a", "c"), "b"))

    ops = parse_collectives(_compiled_text(jnp.sum, x), (2, 2, 2), ("a", "b", "c"))

    assert [(op.kind, op.mesh_axes) for op in ops] == [
        ("all-reduce", ("b",)),
        ("all-reduce", ("a", "c")),
    ]
    assert _as_sets(ops[0].replica_groups) == _axis_groups((2, 2, 2), [1])
    assert _as_sets(ops[1].replica_groups) == _axis_groups((2, 2, 2), [0, 2])


def test_device_ids_are_mesh_positions_not_device_ids():
    # Devices in a scrambled order: partition ids still index mesh positions.
    mesh = _mesh((2, 4), order=(3, 1, 6, 0, 7, 2, 5, 4))
    body = jax.shard_map(
        lambda block: jax.lax.psum(block, "model"),
        mesh=mesh,
        in_specs=P("batch", "model"),
        out_specs=P("batch", "model"),
    )

    (op,) = parse_collectives(
        _compiled_text(body, jnp.ones((16, 32), jnp.float32)), (2, 4), AXES
    )

    assert op.mesh_axes == ("model",)
    assert _as_sets(op.replica_groups) == _axis_groups((2, 4), [1])


def _ring(size):
    return [(i, (i + 1) % size) for i in range(size)]


def _shard_map_collectives(mesh, axis, size):
    def body(block):
        return (
            jax.lax.psum(block, axis),
            jax.lax.all_gather(block, axis, axis=0, tiled=True),
            jax.lax.psum_scatter(block, axis, scatter_dimension=0, tiled=True),
            jax.lax.ppermute(block, axis, _ring(size)),
            jax.lax.all_to_all(block, axis, 0, 1, tiled=True),
        )

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=P("batch", "model"),
        out_specs=P("batch", "model"),
        check_vma=False,
    )


@pytest.mark.parametrize(
    "mesh_shape, axis",
    [
        ((2, 4), "model"),
        ((2, 4), "batch"),
        ((1, 8), "model"),
        ((8, 1), "batch"),
        ((4, 2), "batch"),
        ((4, 2), "model"),
    ],
)
def test_shard_map_collectives(mesh_shape, axis):
    axis_index = AXES.index(axis)
    size = mesh_shape[axis_index]
    mesh = _mesh(mesh_shape)
    program = _shard_map_collectives(mesh, axis, size)
    text = _compiled_text(program, jnp.ones((64, 64), jnp.float32))

    ops = _by_kind(parse_collectives(text, mesh_shape, AXES))

    # Every device holds a 64*64/8-element block, whatever the mesh shape.
    block_bytes = 64 * 64 // 8 * F32
    expected_groups = _axis_groups(mesh_shape, [axis_index])
    # XLA:CPU in jax 0.10.2 keeps psum_scatter as a reduce-scatter.
    assert set(ops) == {
        "all-reduce",
        "all-gather",
        "reduce-scatter",
        "collective-permute",
        "all-to-all",
    }
    expected_bytes = {
        "all-reduce": (block_bytes, block_bytes),
        "all-gather": (block_bytes, block_bytes * size),
        "reduce-scatter": (block_bytes, block_bytes // size),
        "collective-permute": (block_bytes, block_bytes),
        "all-to-all": (block_bytes, block_bytes),
    }
    for kind, op in ops.items():
        assert (op.operand_bytes, op.result_bytes) == expected_bytes[kind], kind
        assert op.mesh_axes == (axis,), kind
        assert _as_sets(op.replica_groups) == expected_groups, kind
    assert len(ops["all-to-all"].operand_shapes) == size
    ring_pairs = {
        (int(source), int(target))
        for group in expected_groups
        for source, target in zip(
            sorted(group), sorted(group)[1:] + sorted(group)[:1], strict=True
        )
    }
    assert set(ops["collective-permute"].source_target_pairs) == ring_pairs


def test_shard_map_psum_over_both_axes():
    mesh = _mesh((2, 4))
    program = jax.shard_map(
        lambda block: jax.lax.psum(block, ("batch", "model")),
        mesh=mesh,
        in_specs=P("batch", "model"),
        out_specs=P(),
        check_vma=False,
    )

    ops = parse_collectives(
        _compiled_text(program, jnp.ones((16, 32), jnp.float32)), (2, 4), AXES
    )

    assert [(op.kind, op.mesh_axes) for op in ops] == [
        ("all-reduce", ("batch", "model"))
    ]
    assert ops[0].replica_groups == (tuple(range(8)),)
    assert ops[0].operand_bytes == 8 * 8 * F32


# ---------------------------------------------------------------------------
# Replica-group syntaxes on hand-written HLO.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "groups_text, mesh_shape, names, expected_groups, expected_axes",
    [
        (
            "{{0,4},{1,5},{2,6},{3,7}}",
            (2, 4),
            AXES,
            ((0, 4), (1, 5), (2, 6), (3, 7)),
            ("batch",),
        ),
        ("{}", (2, 4), AXES, ((0, 1, 2, 3, 4, 5, 6, 7),), ("batch", "model")),
        (
            "{{0,1,2,3,4,5,6,7}}",
            (1, 8),
            AXES,
            ((0, 1, 2, 3, 4, 5, 6, 7),),
            ("model",),
        ),
        (
            "{{0},{1},{2},{3},{4},{5},{6},{7}}",
            (8, 1),
            AXES,
            ((0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)),
            (),
        ),
        ("[2,4]<=[8]", (2, 4), AXES, ((0, 1, 2, 3), (4, 5, 6, 7)), ("model",)),
        (
            "[4,2]<=[2,4]T(1,0)",
            (2, 4),
            AXES,
            ((0, 4), (1, 5), (2, 6), (3, 7)),
            ("batch",),
        ),
        (
            "[4,2]<=[2,2,2]T(0,2,1)",
            (2, 2, 2),
            ("a", "b", "c"),
            ((0, 2), (1, 3), (4, 6), (5, 7)),
            ("b",),
        ),
        (
            "mesh['axis_0'=2,'axis_1'=4] {'axis_0'}",
            (2, 4),
            AXES,
            ((0, 4), (1, 5), (2, 6), (3, 7)),
            ("batch",),
        ),
        (
            "mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0','axis_2'}",
            (2, 4),
            AXES,
            ((0, 1, 2, 3, 4, 5, 6, 7),),
            ("batch", "model"),
        ),
        (
            "mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0'}",
            (2, 2, 2),
            ("a", "b", "c"),
            ((0, 1, 4, 5), (2, 3, 6, 7)),
            ("a", "c"),
        ),
        (
            "mesh['x'=2,'y'=4], device_ids=(0,2,4,6,1,3,5,7) {'y'}",
            (4, 2),
            AXES,
            ((0, 2, 4, 6), (1, 3, 5, 7)),
            ("batch",),
        ),
        # Sub-axes 'x':(pre_size)size of one 8-device axis.
        (
            "mesh['x'=8] {'x':(1)2}",
            (2, 4),
            AXES,
            ((0, 4), (1, 5), (2, 6), (3, 7)),
            ("batch",),
        ),
        (
            "mesh['x'=8] {'x':(2)4}",
            (2, 4),
            AXES,
            ((0, 1, 2, 3), (4, 5, 6, 7)),
            ("model",),
        ),
        (
            "mesh['x'=8] {'x':(1)2,'x':(4)2}",
            (2, 2, 2),
            ("a", "b", "c"),
            ((0, 1, 4, 5), (2, 3, 6, 7)),
            ("a", "c"),
        ),
    ],
)
def test_replica_group_syntaxes(
    groups_text, mesh_shape, names, expected_groups, expected_axes
):
    (op,) = parse_collectives(_all_reduce_with_groups(groups_text), mesh_shape, names)

    assert op.name == "all-reduce.7"
    assert op.replica_groups == expected_groups
    assert op.mesh_axes == expected_axes
    assert op.operand_bytes == 8 * 16 * F32


@pytest.mark.parametrize(
    "groups_text",
    [
        "{{0,1},{2,3},{4,5},{6,7}}",  # a sub-axis of "model" only
        "{{0,5},{1,4},{2,7},{3,6}}",  # diagonal pairs
        "{{0,1,2,3}}",  # devices 4..7 left out
    ],
)
def test_groups_matching_no_axis_subset_have_no_mesh_axes(groups_text):
    (op,) = parse_collectives(_all_reduce_with_groups(groups_text), (2, 4), AXES)

    assert op.mesh_axes is None


@pytest.mark.parametrize(
    "groups_text",
    [
        "devices[2,4]",  # not an XLA form
        "{{0,1},{2,x}}",  # malformed explicit groups
        "{{0,1},{2,9}}",  # id outside the 8 devices
        "[3,3]<=[8]",  # iota sizes that do not match
        "mesh['x'=8] {'z'}",  # axis not in the mesh
        "maximal_mesh[device_id=0] {}",
    ],
)
def test_unparseable_replica_groups_raise_naming_the_instruction(groups_text):
    with pytest.raises(ValueError, match="all-reduce.7"):
        parse_collectives(_all_reduce_with_groups(groups_text), (2, 4), AXES)


def test_module_device_count_must_match_mesh():
    text = _all_reduce_with_groups("{}", header="num_partitions=4")

    with pytest.raises(ValueError, match="4 devices"):
        parse_collectives(text, (2, 4), AXES)


def test_partition_ids_without_global_flag_cover_all_partitions():
    # channel_id without use_global_device_ids: ids are replica ids and each
    # group spans every partition of those replicas.
    text = _hlo(
        "%p0 = f32[8,16]{1,0} parameter(0)",
        "ROOT %ar = f32[8,16]{1,0} all-reduce(%p0), channel_id=3, "
        "replica_groups={{0}}, to_apply=%add",
    )

    (op,) = parse_collectives(text, (2, 4), AXES)

    assert op.replica_groups == (tuple(range(8)),)
    assert op.mesh_axes == ("batch", "model")


def test_cross_replica_all_reduce_in_partitioned_module_is_per_device():
    text = _hlo(
        "%p0 = f32[8,16]{1,0} parameter(0)",
        "ROOT %ar = f32[8,16]{1,0} all-reduce(%p0), replica_groups={}, to_apply=%add",
    )

    (op,) = parse_collectives(text, (2, 4), AXES)

    assert op.replica_groups == tuple((device,) for device in range(8))
    assert op.mesh_axes == ()


def test_replicated_module_uses_replica_ids():
    text = _hlo(
        "%p0 = f32[8,16]{1,0} parameter(0)",
        "ROOT %ar = f32[8,16]{1,0} all-reduce(%p0), "
        "replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add",
        header="replica_count=8, num_partitions=1",
    )

    (op,) = parse_collectives(text, (2, 4), AXES)

    assert op.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert op.mesh_axes == ("model",)


# ---------------------------------------------------------------------------
# Printing variants on hand-written HLO.
# ---------------------------------------------------------------------------


def test_async_all_reduce_pair_is_counted_once():
    text = _hlo(
        "%p0 = f32[8,16]{1,0} parameter(0)",
        "%all-reduce-start = f32[8,16]{1,0} all-reduce-start(f32[8,16]{1,0} %p0), "
        "channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, "
        'to_apply=%add, backend_config={"is_sync":false}',
        "ROOT %all-reduce-done = f32[8,16]{1,0} all-reduce-done("
        "f32[8,16]{1,0} %all-reduce-start)",
    )

    ops = parse_collectives(text, (2, 4), AXES)

    assert len(ops) == 1
    assert ops[0].kind == "all-reduce"
    assert ops[0].name == "all-reduce-start"
    assert ops[0].is_async is True
    assert ops[0].mesh_axes == ("model",)
    assert (ops[0].operand_bytes, ops[0].result_bytes) == (512, 512)


@pytest.mark.parametrize("with_done", [True, False])
def test_async_combined_all_reduce_sums_tuple_elements(with_done):
    pair = "(f32[8,16]{1,0}, f32[16,8]{1,0})"
    lines = [
        "%p0 = f32[8,16]{1,0} parameter(0)",
        "%p1 = f32[16,8]{1,0} parameter(1)",
        f"%ars = {pair} all-reduce-start(%p0, %p1), channel_id=1, "
        "replica_groups={}, use_global_device_ids=true, to_apply=%add",
    ]
    if with_done:
        lines.append(f"%ard = {pair} all-reduce-done(%ars)")
    text = _hlo(*lines, params="p0: f32[8,16], p1: f32[16,8]")

    (op,) = parse_collectives(text, (2, 4), AXES)

    assert op.name == "ars"
    assert op.operand_bytes == 2 * 8 * 16 * F32
    assert op.result_bytes == 2 * 8 * 16 * F32
    assert op.result_shapes == ("f32[8,16]", "f32[16,8]")


def test_async_all_gather_result_comes_from_done():
    text = _hlo(
        "%p0 = f32[8,16]{1,0} parameter(0)",
        "%ag-start = (f32[8,16]{1,0}, f32[16,16]{1,0}) all-gather-start(%p0), "
        "channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, "
        "use_global_device_ids=true",
        "%ag-done = f32[16,16]{1,0} all-gather-done(%ag-start)",
        "ROOT %slice = f32[8,16]{1,0} slice(%ag-done), slice={[0:8], [0:16]}",
    )

    (op,) = parse_collectives(text, (2, 4), AXES)

    assert op.kind == "all-gather"
    assert op.operand_bytes == 8 * 16 * F32
    assert op.result_bytes == 16 * 16 * F32
    assert op.result_shapes == ("f32[16,16]",)
    assert op.mesh_axes == ("batch",)


def test_async_all_gather_without_done_uses_tuple_result():
    text = _hlo(
        "%p0 = f32[8,16]{1,0} parameter(0)",
        "ROOT %ag-start = (f32[8,16]{1,0}, f32[32,16]{1,0}) all-gather-start(%p0), "
        "channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, "
        "use_global_device_ids=true",
    )

    (op,) = parse_collectives(text, (2, 4), AXES)

    assert (op.operand_bytes, op.result_bytes) == (8 * 16 * F32, 32 * 16 * F32)


def test_async_collective_permute_pair():
    text = _hlo(
        "%p0 = f32[8,16]{1,0} parameter(0)",
        "%cp-start = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) "
        "collective-permute-start(%p0), channel_id=4, "
        "source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}",
        "ROOT %cp-done = f32[8,16]{1,0} collective-permute-done(%cp-start)",
    )

    (op,) = parse_collectives(text, (2, 4), AXES)

    assert op.kind == "collective-permute"
    assert op.is_async is True
    assert (op.operand_bytes, op.result_bytes) == (512, 512)
    assert op.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert op.source_target_pairs[:2] == ((0, 4), (4, 0))
    assert op.mesh_axes == ("batch",)


def test_tuple_operands_with_index_comments_and_without_inline_shapes():
    names = [f"%s.{i}" for i in range(6)]
    definitions = [
        f"{name} = bf16[2,8]{{1,0}} slice(%p0), slice={{[0:2], [0:8]}}"
        for name in names
    ]
    result = ", ".join(["bf16[2,8]{1,0}"] * 5 + ["/*index=5*/bf16[2,8]{1,0}"])
    operands = ", ".join(names[:5] + [f"/*index=5*/{names[5]}"])
    text = _hlo(
        "%p0 = bf16[8,16]{1,0} parameter(0)",
        *definitions,
        f"ROOT %a2a = ({result}) all-to-all({operands}), channel_id=1, "
        "replica_groups={{0,1,2,3,4,5},{6,7}}",
        header="num_partitions=8",
    )

    (op,) = parse_collectives(text, (2, 4), AXES)

    assert op.operand_shapes == ("bf16[2,8]",) * 6
    assert op.operand_bytes == 6 * 2 * 8 * 2
    assert op.result_bytes == 6 * 2 * 8 * 2
    assert op.mesh_axes is None


def test_inline_and_resolved_operand_shapes_agree():
    def module(operands):
        return _hlo(
            "%p0 = f32[8,16]{1,0} parameter(0)",
            "%p1 = f32[16,8]{1,0} parameter(1)",
            f"ROOT %ar = (f32[8,16]{{1,0}}, f32[16,8]{{1,0}}) all-reduce({operands}), "
            "channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, "
            "use_global_device_ids=true, to_apply=%add",
            params="p0: f32[8,16], p1: f32[16,8]",
        )

    inline = module("f32[8,16]{1,0} %p0, f32[16,8]{1,0} %p1")
    by_name = module("%p0, %p1")

    (inline_op,) = parse_collectives(inline, (2, 4), AXES)
    (named_op,) = parse_collectives(by_name, (2, 4), AXES)

    assert inline_op == named_op
    assert named_op.operand_shapes == ("f32[8,16]", "f32[16,8]")
    assert named_op.operand_bytes == (8 * 16 + 16 * 8) * F32
    assert named_op.result_bytes == (8 * 16 + 16 * 8) * F32


def test_undefined_operand_raises():
    text = _hlo(
        "ROOT %ar = f32[8,16]{1,0} all-reduce(%missing), channel_id=1, "
        "replica_groups={}, use_global_device_ids=true, to_apply=%add",
    )

    with pytest.raises(ValueError, match="missing"):
        parse_collectives(text, (2, 4), AXES)


@pytest.mark.parametrize(
    "dtype, element_bytes",
    [
        ("pred", 1),
        ("s8", 1),
        ("u8", 1),
        ("f8e4m3fn", 1),
        ("f8e5m2", 1),
        ("s16", 2),
        ("bf16", 2),
        ("f16", 2),
        ("s32", 4),
        ("u32", 4),
        ("f32", 4),
        ("s64", 8),
        ("f64", 8),
        ("c64", 8),
        ("c128", 16),
    ],
)
def test_dtype_byte_sizes(dtype, element_bytes):
    text = _hlo(
        f"%p0 = {dtype}[3,5]{{1,0}} parameter(0)",
        f"ROOT %ag = {dtype}[6,5]{{1,0}} all-gather(%p0), channel_id=1, "
        "replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, "
        "use_global_device_ids=true",
        params=f"p0: {dtype}[3,5]",
    )

    (op,) = parse_collectives(text, (2, 4), AXES)

    assert op.operand_bytes == 15 * element_bytes
    assert op.result_bytes == 30 * element_bytes


def test_collectives_in_nested_computations_record_their_computation():
    text = (
        "HloModule loop, num_partitions=8\n\n"
        + _REDUCER
        + "\n%body (state: f32[4]) -> f32[4] {\n"
        "  %state = f32[4]{0} parameter(0)\n"
        "  ROOT %rs = f32[4]{0} reduce-scatter(%state), channel_id=2, "
        "replica_groups=[2,4]<=[8], use_global_device_ids=true, dimensions={0}, "
        "to_apply=%add\n"
        "}\n\n"
        "ENTRY %main (p0: f32[4]) -> f32[4] {\n"
        "  %p0 = f32[4]{0} parameter(0)\n"
        "  ROOT %ar = f32[4]{0} all-reduce(%p0), channel_id=1, "
        "replica_groups={}, use_global_device_ids=true, to_apply=%add\n"
        "}\n"
    )

    ops = parse_collectives(text, (2, 4), AXES)

    assert [(op.kind, op.name, op.computation) for op in ops] == [
        ("reduce-scatter", "rs", "body"),
        ("all-reduce", "ar", "main"),
    ]


# ---------------------------------------------------------------------------
# Records and summaries.
# ---------------------------------------------------------------------------


def _op(kind, mesh_axes, operand_bytes, result_bytes):
    return CollectiveOp(
        kind=kind,
        name=f"{kind}.1",
        computation="main",
        operand_bytes=operand_bytes,
        result_bytes=result_bytes,
        operand_shapes=("f32[2]",),
        replica_groups=((0, 1),),
        mesh_axes=mesh_axes,
    )


def test_summarize_groups_by_kind_and_mesh_axes():
    ops = [
        _op("all-reduce", ("model",), 512, 512),
        _op("all-gather", ("batch",), 100, 200),
        _op("all-reduce", ("model",), 64, 64),
        _op("all-reduce", None, 8, 8),
        _op("all-reduce", ("batch",), 4, 4),
    ]

    summary = summarize_collectives(ops)

    assert [(row["kind"], row["mesh_axes"], row["count"]) for row in summary] == [
        ("all-gather", ["batch"], 1),
        ("all-reduce", ["batch"], 1),
        ("all-reduce", ["model"], 2),
        ("all-reduce", None, 1),
    ]
    assert summary[2]["operand_bytes"] == 576
    assert summary[2]["result_bytes"] == 576
    assert summary[0]["result_bytes"] == 200
    assert summarize_collectives([]) == []


def test_to_dict_is_json_ready():
    op = CollectiveOp(
        kind="collective-permute",
        name="cp",
        computation="main",
        operand_bytes=16,
        result_bytes=16,
        operand_shapes=("f32[4]",),
        replica_groups=((0, 1),),
        mesh_axes=("model",),
        result_shapes=("f32[4]",),
        source_target_pairs=((0, 1), (1, 0)),
    )

    as_dict = json.loads(json.dumps(op.to_dict()))

    assert as_dict == {
        "kind": "collective-permute",
        "name": "cp",
        "computation": "main",
        "operand_bytes": 16,
        "result_bytes": 16,
        "operand_shapes": ["f32[4]"],
        "replica_groups": [[0, 1]],
        "mesh_axes": ["model"],
        "result_shapes": ["f32[4]"],
        "source_target_pairs": [[0, 1], [1, 0]],
        "is_async": False,
        "scattered_bytes": 0,
    }


def _row_parallel(mesh, output_spec):
    """A row-parallel matmul (contraction cut over "model") whose output is
    laid out as `output_spec`, then used elementwise."""
    x = _placed(mesh, (8, 16, 32), P(None, None, "model"))
    w = _placed(mesh, (32, 32), P("model", None))

    def layer(x, w):
        out = jnp.einsum("bsh,hk->bsk", x, w)
        out = jax.lax.with_sharding_constraint(out, NamedSharding(mesh, output_spec))
        return jnp.tanh(out) * 2.0

    return _compiled_text(layer, x, w)


def test_all_reduce_sliced_by_partition_counts_as_reduce_scatter():
    mesh = _mesh((2, 4))
    text = _row_parallel(mesh, P(None, "model", None))

    (op,) = parse_collectives(text, (2, 4), AXES)

    # XLA:CPU writes the reduce-scatter as an all-reduce whose readers keep
    # this device's quarter of the tokens.
    whole = 8 * 16 * 32 * F32
    assert op.kind == "all-reduce"
    assert op.operand_bytes == whole
    assert op.scattered_bytes == whole
    assert op.ring_bytes == 3 / 4 * whole


def test_all_reduce_kept_whole_counts_twice_on_the_ring():
    mesh = _mesh((2, 4))
    text = _row_parallel(mesh, P(None, None, None))

    (op,) = parse_collectives(text, (2, 4), AXES)

    whole = 8 * 16 * 32 * F32
    assert op.kind == "all-reduce"
    assert op.scattered_bytes == 0
    assert op.ring_bytes == 2 * 3 / 4 * whole
