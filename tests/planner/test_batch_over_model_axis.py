"""The batch over a model axis where no data axis can cut it (1x8).

On a mesh whose data axis has one device (`AutoShardDistribution()`'s default
on 8 devices is 1x8), a small model used to stay whole on every device: each
of the eight repeated the whole step. The planner now lets the model axis cut
the batch there too, and keeps the plan that leaves the least compute repeated
on the devices, then moves the fewest bytes (`search._batch_over_model_axes`):
data parallelism over 'model' where tensor parallelism would repeat some of
the work (layers too narrow to cut eight ways), tensor parallelism where it
repeats none and moves fewer bytes, within the memory budget.
"""

import jax
import keras
import numpy as np

import keras_autoshard as ka
from tests.parity import check_parity, distribute_batch

MESH_1x8 = ka.MeshSpec((1, 8), ("batch", "model"))


def narrow_mlp():
    # No width that 8 divides: tensor parallelism over 'model' could cut no
    # product, and would repeat every one on every device.
    inputs = keras.Input((12,), name="features")
    hidden = keras.layers.Dense(20, activation="relu", name="up")(inputs)
    hidden = keras.layers.Dense(36, activation="relu", name="mid")(hidden)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(hidden))


def wide_mlp():
    # Every width divides 8 and the kernels (2 x 1024 x 1024 floats) outweigh
    # the activations of a batch of 8 a thousand times: tensor parallelism
    # repeats no product and moves far fewer bytes than the gradients.
    inputs = keras.Input((1024,), name="features")
    hidden = keras.layers.Dense(1024, activation="relu", name="up")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1024, name="down")(hidden))


def _batch(rows, features, outputs, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features)).astype("float32")
    return x, rng.standard_normal((rows, outputs)).astype("float32")


def test_a_narrow_model_on_1x8_cuts_its_batch_over_model_and_trains_like_one_device():
    x, y = _batch(16, 12, 10)
    dist = ka.AutoShardDistribution(device_mesh=MESH_1x8)
    check_parity(narrow_mlp, dist, x, y, steps=2)
    plan = dist.plan
    assert plan.batch_axis == "model", plan.summary()
    assert all(v.spec == (None,) * len(v.shape) for v in plan.variables)
    assert not [n for n in plan.notes if "kept whole on every device" in n]
    (rows,) = jax.tree_util.tree_leaves(distribute_batch(dist, x))
    assert {s.data.shape[0] for s in rows.addressable_shards} == {2}
    assert len({s.index[0].start for s in rows.addressable_shards}) == 8


def test_data_parallel_over_model_runs_an_eighth_of_the_step_per_device():
    # Read off XLA's cost analysis of the compiled train steps: each device
    # of the 1x8 plan runs about 1/8 of one device's FLOPs. The optimizer
    # update, elementwise on whole weights, is repeated on every device:
    # measured 1.03/8 with 512 rows (1.23/8 with 64, where it weighs more).
    from keras_autoshard import inspect_compiled

    x, y = _batch(512, 12, 10)
    dist = ka.AutoShardDistribution(device_mesh=MESH_1x8)
    with dist.scope():
        model = narrow_mlp()
        model.compile(optimizer="adam", loss="mse")
    sharded = inspect_compiled(model, dist, (x, y), with_forward_step=False)
    one_device = keras.distribution.DeviceMesh(
        (1, 1), ["batch", "model"], devices=keras.distribution.list_devices()[:1]
    )
    one = ka.AutoShardDistribution(device_mesh=one_device)
    with one.scope():
        single = narrow_mlp()
        single.compile(optimizer="adam", loss="mse")
    whole = inspect_compiled(single, one, (x, y), with_forward_step=False)
    assert dist.plan.batch_axis == "model"
    ratio = sharded.train_step.flops / whole.train_step.flops
    assert 1 / 8 <= ratio <= 1.1 / 8, ratio
    assert sharded.train_step.count("all-reduce", ("model",)) >= 1


def test_tensor_parallelism_is_kept_where_it_repeats_nothing_and_moves_less():
    x, _ = _batch(8, 1024, 1024)
    plan = ka.plan(wide_mlp, MESH_1x8, sample_input=x)
    assert plan.batch_axis is None, plan.summary()
    kernels = [v for v in plan.variables if v.path.endswith("kernel")]
    specs = {v.path.split("/")[-2]: v.spec for v in kernels}
    assert specs == {"up": (None, "model"), "down": ("model", None)}, specs
    (note,) = [n for n in plan.notes if "kept whole on every device" in n]
    assert "its batch (8 rows) is kept whole on every device" in note
    assert "cutting the model over 'model' repeats no more matrix products" in note


def test_a_batch_that_divides_no_axis_stays_whole_and_the_note_says_so():
    x, _ = _batch(12, 12, 10)
    plan = ka.plan(narrow_mlp, MESH_1x8, sample_input=x)
    assert plan.batch_axis is None
    (note,) = [n for n in plan.notes if "kept whole on every device" in n]
    assert "12 rows divide no mesh axis ('model' (size 8))" in note
    assert "a multiple of 8" in note


def wide_then_narrow_mlp():
    # A wide kernel (4 MiB), then a product of widths 10 and 12, which 8
    # does not divide: tensor parallelism repeats it on every device.
    inputs = keras.Input((1024,), name="features")
    hidden = keras.layers.Dense(1024, activation="relu", name="up")(inputs)
    hidden = keras.layers.Dense(10, activation="relu", name="narrow")(hidden)
    return keras.Model(inputs, keras.layers.Dense(12, name="head")(hidden))


def test_a_budget_no_whole_kernel_fits_keeps_tensor_parallelism():
    # Without a budget data parallelism wins (tensor parallelism would repeat
    # the narrow product). Under a budget it may still, with every weight
    # stored cut over 'model' (ZeRO-3): each device then gathers the wide
    # kernel whole (4 MiB) for its product and holds its whole gradient
    # before the reduce-scatter. A budget of a fifth of the whole state
    # (3.2 MiB, plans fill 90 % of it) holds neither: only tensor
    # parallelism, each device a slice of the kernel, fits.
    x, _ = _batch(8, 1024, 12)
    free = ka.plan(wide_then_narrow_mlp, MESH_1x8, sample_input=x)
    assert free.batch_axis == "model", free.summary()
    whole_state = 4 * sum(v.total_bytes for v in free.variables)
    budget = whole_state // 5
    plan = ka.plan(wide_then_narrow_mlp, MESH_1x8, sample_input=x, memory_budget=budget)
    assert plan.batch_axis is None, plan.summary()
    (up,) = [v for v in plan.variables if v.path.endswith("up/kernel")]
    assert "model" in up.spec, plan.summary()
    assert plan.estimate.peak_bytes <= budget
    (note,) = [n for n in plan.notes if "kept whole on every device" in n]
    assert "fits the memory budget where cutting the batch does not" in note


def test_tensor_parallel_keeps_its_model_axis_for_the_model():
    # `TensorParallel(world_size=8)` cuts each model copy over 8 devices, as
    # asked, where `plan` would put the batch over 'model' (above).
    x, _ = _batch(8, 1024, 12)
    wrapped = ka.TensorParallel(wide_then_narrow_mlp(), world_size=8)
    plan = wrapped.prepare(x)
    assert plan.batch_axis is None, plan.summary()
    (up,) = [v for v in plan.variables if v.path.endswith("up/kernel")]
    assert "model" in up.spec, plan.summary()
