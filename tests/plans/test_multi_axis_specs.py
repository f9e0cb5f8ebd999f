"""A dim cut over several mesh axes at once (`("batch", "model")`): plans,
rules, JSON, tables, `LayoutMap`s and the JAX backend handle it, and a model
trained that way matches one device."""

import collections

import jax
import keras
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from keras_autoshard import MeshSpec, PlanDistribution
from keras_autoshard.apply.jax.device_mesh import make_device_mesh
from keras_autoshard.building import names_replayed_after
from keras_autoshard.errors import PlanError
from keras_autoshard.plans.rules import plan_from_rules
from keras_autoshard.plans.sharding_plan import ShardingPlan, VariableSharding
from keras_autoshard.runtime.jax_processes import batch_share
from keras_autoshard.testing import zoo
from tests.parity import check_parity, distribute_batch

MESH = MeshSpec((2, 4), ("batch", "model"))
EVERY_AXIS = ("batch", "model")
# The batch over all 8 devices, and each kernel's storage cut 8 ways (the
# up kernel's rows over batch-major devices, the down kernel's columns in the
# other order: model major).
RULES = {
    "up/kernel": (EVERY_AXIS, None),
    "down/kernel": (None, ("model", "batch")),
}


def multi_axis_plan() -> ShardingPlan:
    with names_replayed_after():
        model = zoo.build_mlp_block()
    return plan_from_rules(model.variables, MESH, RULES, batch_axis=EVERY_AXIS)


def test_batch_and_storage_over_both_axes_match_one_device_after_5_adam_steps():
    plan = multi_axis_plan()
    x, y = zoo.mlp_batch()
    distribution = PlanDistribution(plan)
    _, sharded = check_parity(zoo.build_mlp_block, distribution, x, y)
    for v in sharded.variables:
        expected = plan.variable(v.path).bytes_per_device(MESH)
        assert {s.data.nbytes for s in v.value.addressable_shards} == {expected}
    assert plan.variable("up/kernel").bytes_per_device(MESH) == 64 * 256 * 4 // 8
    # Each device holds one eighth of the batch.
    (x_sharded,) = jax.tree_util.tree_leaves(distribute_batch(distribution, x))
    assert {s.data.shape[0] for s in x_sharded.addressable_shards} == {len(x) // 8}


def test_the_order_of_an_entry_is_the_order_of_the_cut():
    # ("model", "batch"): the model axis is major, so the device at mesh
    # position (b, m) holds block m * 2 + b of the down kernel's columns.
    plan = multi_axis_plan()
    with PlanDistribution(plan).scope():
        model = zoo.build_mlp_block()
    kernel = next(v for v in model.variables if v.path == "down/kernel").value
    columns = kernel.shape[1] // 8
    mesh_devices = make_device_mesh(MESH).backend_mesh.devices
    for shard in kernel.addressable_shards:
        (b,), (m,) = np.nonzero(mesh_devices == shard.device)
        assert shard.index[1].start == (m * 2 + b) * columns


def test_multi_axis_entries_survive_json_tables_and_layout_maps():
    plan = multi_axis_plan()
    text = plan.to_json()
    assert '"batch_axis": [\n    "batch",\n    "model"\n  ]' in text
    again = ShardingPlan.from_json(text)
    assert again == plan
    assert again.batch_axis == EVERY_AXIS
    assert again.variable("down/kernel").spec == (None, ("model", "batch"))
    table = plan.summary()
    assert "(batch+model, -)" in table and "(-, model+batch)" in table
    assert "batch on 'batch+model'" in table
    assert "up/kernel [?, ?] -> (batch+model, -)" in plan.explain()
    assert "batch on 'batch+model'" in plan.explain().splitlines()[0]
    layout_map = plan.to_layout_map(make_device_mesh(MESH))
    spec = layout_map["up/kernel"].backend_layout.spec
    assert spec == PartitionSpec(EVERY_AXIS, None)
    assert layout_map["down/kernel"].backend_layout.spec == PartitionSpec(
        None, ("model", "batch")
    )


def test_one_axis_and_no_axis_entries_have_one_spelling():
    one = VariableSharding("k", (8, 8), "float32", (("model",), ()))
    assert one.spec == ("model", None)
    assert ShardingPlan(MESH, (one,), batch_axis=["batch"]).batch_axis == "batch"


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            (("batch", "tensor"), None),
            "dim 0 names mesh axis 'tensor', which does not exist",
        ),
        (
            (EVERY_AXIS, "model"),
            "mesh axis 'model' shards both dim 0 and dim 1",
        ),
        ((("model", "model"), None), "mesh axis 'model' shards twice in dim 0"),
        (
            (None, EVERY_AXIS),
            "dim 1 has size 12, which mesh axes ('batch', 'model') of sizes "
            "[2, 4] (together 8) does not divide",
        ),
    ],
)
def test_a_bad_multi_axis_entry_is_named(spec, message):
    with names_replayed_after():
        model = _dense(12)
    with pytest.raises(PlanError) as error:
        plan_from_rules(model.variables, MESH, {"w/kernel": spec}, batch_axis="batch")
    assert message in str(error.value)


Device = collections.namedtuple("Device", "id process_index")


def test_a_batch_over_both_axes_falls_onto_processes_batch_major():
    # 2x4 mesh, 4 processes of 2 neighbouring model positions each: over
    # ("batch", "model") process p owns batch positions 2p and 2p + 1, so the
    # batch is cut into 4 per-process parts.
    devices = np.empty((2, 4), dtype=object)
    for b, m in np.ndindex(2, 4):
        devices[b, m] = Device(4 * b + m, (4 * b + m) // 2)
    shares, _ = batch_share(devices, MESH.axis_names, EVERY_AXIS)
    assert shares == 4
    # Over ("model", "batch") the processes alternate: not contiguous.
    from keras_autoshard.errors import ClusterError

    with pytest.raises(ClusterError, match="same processes in several"):
        batch_share(devices, MESH.axis_names, ("model", "batch"))


def test_dtensor_placements_shard_a_dim_on_every_mesh_dim_in_mesh_order():
    pytest.importorskip("torch")
    from torch.distributed.tensor import Replicate, Shard

    from keras_autoshard.apply.torch.dtensor_layout import placements_for

    assert placements_for((EVERY_AXIS, None), MESH) == [Shard(0), Shard(0)]
    assert placements_for((None, "model"), MESH) == [Replicate(), Shard(1)]
    with pytest.raises(PlanError, match=r"Write the entry as \('batch', 'model'\)"):
        placements_for((None, ("model", "batch")), MESH)


def _dense(width):
    inputs = keras.Input((16,))
    return keras.Model(inputs, keras.layers.Dense(width, name="w")(inputs))


def test_a_planner_rule_with_a_multi_axis_entry_is_an_error_naming_it():
    import keras_autoshard as ka

    x = np.zeros((8, 16), "float32")
    with pytest.raises(PlanError, match=r"'w/kernel' cuts dim 0 over several mesh"):
        ka.plan(
            lambda: _dense(16),
            MESH,
            sample_input=x,
            rules={"w/kernel": (EVERY_AXIS, None)},
        )
    # A product that does not divide is named with the rule before any search.
    with pytest.raises(PlanError, match=r"dim 1 has size 12.*'batch' x 'model'"):
        ka.plan(
            lambda: _dense(12),
            MESH,
            sample_input=x,
            rules={"w/kernel": (None, EVERY_AXIS)},
        )


def test_a_checkpoint_saved_under_a_multi_axis_plan_restores_bit_exactly(tmp_path):
    # Saved with its plan (tuple entries stored as JSON lists), restored onto
    # the Megatron layout of the same mesh, and back onto the multi-axis one.
    from keras_autoshard import restore_checkpoint, save_checkpoint
    from tests.checkpoint.test_checkpoint_orbax import (
        assert_same_state,
        compiled_mlp,
        mlp_plan,
        state_arrays,
        trained_mlp,
    )

    plan = multi_axis_plan()
    source = trained_mlp(PlanDistribution(plan))
    expected = state_arrays(source)
    save_checkpoint(source, tmp_path / "ckpt", step=2, plan=plan)
    megatron = compiled_mlp(PlanDistribution(mlp_plan(MESH)), seed=7)
    restored = restore_checkpoint(megatron, tmp_path / "ckpt")
    assert restored.plan == plan and restored.plan.batch_axis == EVERY_AXIS
    assert_same_state(megatron, expected)
    save_checkpoint(megatron, tmp_path / "megatron", step=3)
    again = compiled_mlp(PlanDistribution(plan), seed=8)
    restore_checkpoint(again, tmp_path / "megatron")
    assert_same_state(again, expected)
    kernel = again.get_layer("up").kernel.value
    assert {s.data.shape for s in kernel.addressable_shards} == {(64 // 8, 256)}


def test_the_table_spelling_of_an_entry_reads_back_as_the_tuple():
    entry = VariableSharding("k", (8, 8), "float32", ("batch+model", None))
    assert entry.spec == (EVERY_AXIS, None)
    with pytest.raises(PlanError, match="may not contain '\\+'"):
        MeshSpec((2, 4), ("data+x", "model"))
