"""Orbax checkpoints of sharded models: save, restore onto other meshes, the
callback, and clear errors for damaged or foreign checkpoints."""

import gc
import json
import os

import keras
import numpy as np
import pytest

from keras_autoshard import (
    AutoShardDistribution,
    MeshSpec,
    PlanDistribution,
    load_model_sharded,
    make_device_mesh,
    plan_from_rules,
    restore_checkpoint,
    save_checkpoint,
)
from keras_autoshard.checkpoint.orbax_callback import ShardedOrbaxCheckpoint
from keras_autoshard.checkpoint.steps import complete_steps
from keras_autoshard.errors import CheckpointError
from keras_autoshard.testing import zoo

MESH_2x4 = MeshSpec((2, 4), ("batch", "model"))
MESH_1x8 = MeshSpec((1, 8), ("batch", "model"))
MESH_1x4 = MeshSpec((1, 4), ("batch", "model"))
MEGATRON_RULES = {
    "up/kernel": (None, "model"),
    "up/bias": ("model",),
    "down/kernel": ("model", None),
}


def mlp_plan(mesh):
    return plan_from_rules(
        zoo.build_mlp_block().variables, mesh, MEGATRON_RULES, "batch"
    )


def compiled_mlp(distribution=None, seed=0) -> keras.Model:
    """An MLP block with a built Adam named `adam` (state-tree keys match)."""
    keras.utils.set_random_seed(seed)
    scope = distribution.scope() if distribution is not None else _no_scope()
    with scope:
        model = zoo.build_mlp_block()
        model.compile(optimizer=keras.optimizers.Adam(name="adam"), loss="mse")
        model.optimizer.build(model.trainable_variables)
    return model


class _no_scope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def trained_mlp(distribution, steps=2, seed=0) -> keras.Model:
    model = compiled_mlp(distribution, seed)
    x, y = zoo.mlp_batch(seed=seed)
    with distribution.scope():
        for _ in range(steps):
            model.train_on_batch(x, y)
    return model


def state_arrays(model) -> dict[str, np.ndarray]:
    flat = {}

    def walk(tree, prefix):
        for key, value in tree.items():
            name = f"{prefix}/{key}"
            if isinstance(value, dict):
                walk(value, name)
            else:
                flat[name] = np.asarray(value)

    walk(model.get_state_tree(), "")
    return flat


def assert_same_state(model, expected: dict[str, np.ndarray]):
    actual = state_arrays(model)
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype, name
        assert np.array_equal(actual[name], value), name


def test_restore_onto_other_meshes_and_devices_is_bit_exact(tmp_path):
    plan = mlp_plan(MESH_2x4)
    source = trained_mlp(PlanDistribution(plan))
    expected = state_arrays(source)
    save_checkpoint(source, tmp_path / "ckpt", step=2, plan=plan, metadata={"a": 1})

    targets = {
        "1x8": PlanDistribution(mlp_plan(MESH_1x8)),
        "1x4 on 4 devices": PlanDistribution(
            mlp_plan(MESH_1x4),
            make_device_mesh(MESH_1x4, keras.distribution.list_devices()[:4]),
        ),
        "single device": None,
    }
    for name, distribution in targets.items():
        model = compiled_mlp(distribution, seed=7)
        restored = restore_checkpoint(model, tmp_path / "ckpt")
        assert_same_state(model, expected)
        assert restored.step == 2 and restored.plan == plan, name
        assert restored.metadata == {"a": 1}
        kernel = model.get_layer("up").kernel.value
        device_count = {"1x8": 8, "1x4 on 4 devices": 4, "single device": 1}[name]
        assert len(kernel.sharding.device_set) == device_count, name
        assert {s.data.shape for s in kernel.addressable_shards} == {
            (64, 256 // device_count if device_count > 1 else 256)
        }, name

    # ... and back: single device → 2x4.
    single = compiled_mlp(None, seed=7)
    restore_checkpoint(single, tmp_path / "ckpt")
    save_checkpoint(single, tmp_path / "single", step=5)
    back = compiled_mlp(PlanDistribution(plan), seed=8)
    assert restore_checkpoint(back, tmp_path / "single").plan is None
    assert_same_state(back, expected)


def test_async_save_keeps_the_values_of_when_it_was_called(tmp_path):
    distribution = PlanDistribution(mlp_plan(MESH_2x4))
    model = trained_mlp(distribution, steps=1)
    expected = state_arrays(model)

    pending = save_checkpoint(model, tmp_path / "ckpt", step=1, wait=False)
    x, y = zoo.mlp_batch(seed=3)
    with distribution.scope():
        model.train_on_batch(x, y)  # training goes on while step 1 is written
    pending.wait()

    assert complete_steps(tmp_path / "ckpt") == [1]
    restored_model = compiled_mlp(distribution, seed=9)
    restore_checkpoint(restored_model, tmp_path / "ckpt")
    assert_same_state(restored_model, expected)


class CountingIterator:
    """A data iterator with Grain-style `get_state` / `set_state`."""

    def __init__(self):
        self.position = 0

    def get_state(self):
        return {"position": self.position}

    def set_state(self, state):
        self.position = state["position"]


class AdvanceIterator(keras.callbacks.Callback):
    def __init__(self, iterator):
        super().__init__()
        self.iterator = iterator

    def on_train_batch_begin(self, batch, logs=None):
        self.iterator.position += 1


def test_callback_saves_every_n_batches_with_plan_metadata_and_iterator_state(
    tmp_path,
):
    plan = mlp_plan(MESH_2x4)
    distribution = PlanDistribution(plan)
    model = compiled_mlp(distribution)
    iterator = CountingIterator()
    callback = ShardedOrbaxCheckpoint(
        str(tmp_path / "ckpt"),
        save_freq=2,
        max_to_keep=2,
        metadata=lambda step: {"saved_at": step},
        data_iterator=iterator,
    )
    x = np.concatenate([zoo.mlp_batch(seed=s)[0] for s in range(4)])
    y = np.concatenate([zoo.mlp_batch(seed=s)[1] for s in range(4)])
    with distribution.scope():
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=2,
            verbose=0,
            shuffle=False,
            callbacks=[AdvanceIterator(iterator), callback],
        )
    callback.wait_until_finished()
    expected = state_arrays(model)

    assert complete_steps(tmp_path / "ckpt") == [6, 8]
    auto = AutoShardDistribution(device_mesh=MESH_1x8)
    with auto.scope():
        target = zoo.build_mlp_block()
        target.compile(optimizer=keras.optimizers.Adam(name="adam"), loss="mse")
    auto.prepare(target, zoo.mlp_batch()[0])
    fresh_iterator = CountingIterator()
    with auto.scope():  # the optimizer state is built there, sharded
        restored = restore_checkpoint(
            target, tmp_path / "ckpt", data_iterator=fresh_iterator
        )

    assert_same_state(target, expected)
    assert restored.plan == plan
    assert restored.metadata == {"saved_at": 8}
    assert fresh_iterator.position == 8
    momentum = target.optimizer.variables[2].value  # first slot after counters
    assert len(momentum.sharding.device_set) == 8
    # Keras's own loader reads the same checkpoint.
    plain = compiled_mlp(distribution, seed=5)
    plain.load_weights(str(tmp_path / "ckpt"))
    assert_same_state(plain, expected)


class ScriptedMetric(keras.callbacks.Callback):
    """Sets `logs["score"]` at each epoch end from a fixed sequence."""

    def __init__(self, scores):
        super().__init__()
        self.scores = list(scores)

    def on_epoch_end(self, epoch, logs=None):
        logs["score"] = self.scores[epoch]


def test_callback_best_only_keeps_the_best_epochs(tmp_path):
    distribution = PlanDistribution(mlp_plan(MESH_2x4))
    model = compiled_mlp(distribution)
    callback = ShardedOrbaxCheckpoint(
        str(tmp_path / "ckpt"),
        monitor="score",
        mode="min",
        save_best_only=True,
        max_to_keep=2,
        save_on_background=False,
    )
    x, y = zoo.mlp_batch()
    with distribution.scope():
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=5,
            verbose=0,
            callbacks=[ScriptedMetric([3.0, 1.0, 2.0, 0.5, 0.7]), callback],
        )

    # Improvements at epochs 0, 1 and 3; the two latest of them are kept.
    assert complete_steps(tmp_path / "ckpt") == [1, 3]


def test_model_rebuilt_from_stored_config_under_another_mesh(tmp_path):
    plan = mlp_plan(MESH_2x4)
    distribution = PlanDistribution(plan)
    source = trained_mlp(distribution)
    expected = state_arrays(source)
    with distribution.scope():  # the active distribution's plan is stored
        save_checkpoint(source, tmp_path / "ckpt", step=4)

    target_plan = mlp_plan(MESH_1x8)
    model, restored = load_model_sharded(
        tmp_path / "ckpt", PlanDistribution(target_plan)
    )

    assert restored.step == 4 and restored.plan == plan
    assert [v.path for v in model.variables] == [v.path for v in source.variables]
    assert_same_state(model, expected)
    kernel = model.get_layer("up").kernel.value
    assert {s.data.shape for s in kernel.addressable_shards} == {(64, 32)}


# ------------------------------------------------------------------ failures
def test_missing_shard_file_is_an_error_naming_the_checkpoint(tmp_path):
    model = trained_mlp(PlanDistribution(mlp_plan(MESH_2x4)), steps=1)
    save_checkpoint(model, tmp_path / "ckpt", step=1)
    data_dir = tmp_path / "ckpt" / "1" / "pytree"
    data_files = [
        os.path.join(root, name)
        for root, _, names in os.walk(data_dir)
        for name in names
        if os.sep + "d" + os.sep in os.path.join(root, name) + os.sep
        or os.path.basename(root) == "d"
    ]
    assert data_files
    for name in data_files:
        os.remove(name)
    target = compiled_mlp(PlanDistribution(mlp_plan(MESH_1x8)), seed=3)

    with pytest.raises(CheckpointError, match=str(tmp_path / "ckpt" / "1")):
        restore_checkpoint(target, tmp_path / "ckpt")
    # Orbax leaves futures of the failed reads unretrieved; collect them here,
    # where asyncio logs them, rather than inside a later test.
    gc.collect()


def test_other_model_and_other_shapes_are_errors_naming_variables(tmp_path):
    model = trained_mlp(PlanDistribution(mlp_plan(MESH_2x4)), steps=1)
    save_checkpoint(model, tmp_path / "ckpt", step=1)

    other = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4, name="d")])
    with pytest.raises(CheckpointError, match="another model"):
        restore_checkpoint(other, tmp_path / "ckpt")

    keras.utils.set_random_seed(0)
    wide = zoo.build_mlp_block(hidden=32)
    wide.compile(optimizer=keras.optimizers.Adam(name="adam"), loss="mse")
    with pytest.raises(CheckpointError, match=r"trainable_variables/up/kernel"):
        restore_checkpoint(wide, tmp_path / "ckpt")


def test_damaged_metadata_and_empty_directory_are_errors(tmp_path):
    model = trained_mlp(PlanDistribution(mlp_plan(MESH_2x4)), steps=1)
    with pytest.raises(CheckpointError, match="No complete checkpoint"):
        restore_checkpoint(model, tmp_path / "nothing")
    save_checkpoint(model, tmp_path / "ckpt", step=1)
    with open(tmp_path / "ckpt" / "1" / "pytree" / "_METADATA", "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match=str(tmp_path / "ckpt" / "1")):
        restore_checkpoint(model, tmp_path / "ckpt")


def test_save_progress_bar_counts_this_process_shard_bytes(tmp_path, capfd):
    inputs = keras.Input((256,))
    outputs = keras.layers.Dense(1024, name="wide")(inputs)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.zeros((8, 256)), np.zeros((8, 1024)), verbose=0)
    save_checkpoint(model, tmp_path / "ckpt", step=1, progress=True)
    # Parameters and Adam's two moments, in MiB, on this single process.
    weights_mib = (256 * 1024 + 1024) * 4 * 3 / 2**20
    bar = capfd.readouterr().err
    assert "saving step 1 (MiB)" in bar
    assert f"{weights_mib:.0f}/{weights_mib:.0f}" in bar.replace(" ", "")
    assert complete_steps(tmp_path / "ckpt") == [1]


def test_restore_into_a_second_model_whose_optimizer_keras_named_adam_1(tmp_path):
    # Keras names optimizers by a process-wide counter: the restoring model's
    # Adam is "adam_1" (or later), the saving model's was not.
    distribution = PlanDistribution(mlp_plan(MESH_2x4))
    keras.utils.set_random_seed(0)
    with distribution.scope():
        saved = zoo.build_mlp_block()
        saved.compile(optimizer="adam", loss="mse")
        x, y = zoo.mlp_batch(seed=0)
        for _ in range(2):
            saved.train_on_batch(x, y)
    save_checkpoint(saved, str(tmp_path), step=1, plan=distribution.plan)
    with distribution.scope():
        restored = zoo.build_mlp_block()
        restored.compile(optimizer="adam", loss="mse")
        restored.optimizer.build(restored.trainable_variables)
    assert saved.optimizer.name != restored.optimizer.name
    restore_checkpoint(restored, str(tmp_path))
    for target, source in zip(restored.variables, saved.variables):
        assert np.array_equal(np.asarray(target.value), np.asarray(source.value))
    pairs = zip(restored.optimizer.variables, saved.optimizer.variables)
    for target, source in pairs:
        assert np.array_equal(np.asarray(target.value), np.asarray(source.value))
    assert int(restored.optimizer.iterations.value) == 2


def test_a_damaged_stored_plan_is_an_error_naming_the_file_before_assigning(
    tmp_path,
):
    plan = mlp_plan(MESH_2x4)
    source = trained_mlp(PlanDistribution(plan), steps=1)
    save_checkpoint(source, tmp_path / "ckpt", step=1, plan=plan)
    record_file = tmp_path / "ckpt" / "1" / "_CHECKPOINT_METADATA"
    record = json.loads(record_file.read_text())
    del record["custom_metadata"]["keras_autoshard"]["plan"]["variables"]
    record_file.write_text(json.dumps(record))
    target = compiled_mlp(PlanDistribution(plan), seed=7)
    before = state_arrays(target)
    with pytest.raises(CheckpointError, match=f"plan stored in {record_file}"):
        restore_checkpoint(target, tmp_path / "ckpt")
    assert_same_state(target, before)


class _BrokenPlanDistribution(keras.distribution.DataParallel):
    """A distribution whose plan cannot be read for another reason than
    not having planned yet."""

    @property
    def plan(self):
        raise RuntimeError("the plan store is unreachable")


def test_save_stores_no_plan_only_when_the_distribution_has_none_yet(tmp_path):
    model = compiled_mlp(None)
    with AutoShardDistribution().scope():  # not planned yet: PlanError
        save_checkpoint(model, tmp_path / "ckpt", step=1)
    assert restore_checkpoint(model, tmp_path / "ckpt").plan is None
    with _BrokenPlanDistribution().scope():
        with pytest.raises(RuntimeError, match="unreachable"):
            save_checkpoint(model, tmp_path / "ckpt", step=2)
