"""Loading Keras, safetensors and KerasHub-preset weights into sharded zoo.

Every test compares loaded values bit for bit with the model that wrote the
file, and checks that each read is one device slice, never a whole array.
"""

import json
import os

import keras
import numpy as np
import pytest
from safetensors.numpy import save_file

from keras_autoshard import (
    AutoShardDistribution,
    MeshSpec,
    PlanDistribution,
    load_weights_sharded,
    plan_from_rules,
)
from keras_autoshard.building import names_replayed_after
from keras_autoshard.checkpoint.sharded_load import load_preset_sharded
from keras_autoshard.errors import CheckpointError
from keras_autoshard.io.keras_weights_layout import keras_h5_keys
from keras_autoshard.testing import zoo

MESH = MeshSpec((2, 4), ("batch", "model"))
MEGATRON_RULES = {
    "up/kernel": (None, "model"),
    "up/bias": ("model",),
    "down/kernel": ("model", None),
}


def mlp_plan(mesh=MESH):
    reference = zoo.build_mlp_block()
    return plan_from_rules(reference.variables, mesh, MEGATRON_RULES, "batch")


def seeded_mlp(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = zoo.build_mlp_block()
    for variable in model.variables:  # biases and norms too, not only kernels
        noise = np.random.default_rng(seed).standard_normal(variable.shape)
        variable.assign(noise.astype(variable.dtype))
    return model


def sharded_mlp(plan) -> keras.Model:
    keras.utils.set_random_seed(99)  # other initial values than the source
    with PlanDistribution(plan).scope():
        return zoo.build_mlp_block()


def assert_same_values(loaded, source):
    """Every variable Keras saves is equal bit for bit (seed-generator states
    are not part of Keras weights files)."""
    loaded_vars = keras_h5_keys(loaded)
    source_vars = keras_h5_keys(source)
    assert list(loaded_vars) == list(source_vars)
    for key, target in loaded_vars.items():
        expected = np.asarray(source_vars[key].value)
        assert np.array_equal(np.asarray(target.value), expected), key


class ReadLog:
    """Records every slice read: (file key, bytes)."""

    def __init__(self):
        self.reads: list[tuple[str, int]] = []

    def __call__(self, key, index, nbytes):
        self.reads.append((key, nbytes))


def assert_reads_are_device_slices(model, log: ReadLog, key_of):
    """Each read is exactly one device's slice of its variable."""
    slice_bytes = {}
    for variable in model.variables:
        if variable.path not in key_of:
            continue
        shards = variable.value.addressable_shards
        sizes = {shard.data.nbytes for shard in shards}
        assert len(sizes) == 1, variable.path
        slice_bytes[key_of[variable.path]] = sizes.pop()
    assert log.reads, "nothing was read"
    for key, nbytes in log.reads:
        assert nbytes == slice_bytes[key], key


def test_weights_h5_loads_bit_exact_reading_one_device_slice_per_read(tmp_path):
    source = seeded_mlp(seed=1)
    path = str(tmp_path / "mlp.weights.h5")
    source.save_weights(path)
    plan = mlp_plan()
    model = sharded_mlp(plan)
    log = ReadLog()

    report = load_weights_sharded(model, path, on_read=log)

    assert_same_values(model, source)
    key_of = {v.path: k for k, v in keras_h5_keys(model).items()}
    assert_reads_are_device_slices(model, log, key_of)
    kernel = model.get_layer("up").kernel.value
    assert {s.data.shape for s in kernel.addressable_shards} == {(64, 64)}
    assert report.max_read_bytes == 64 * 64 * 4  # a quarter of up/kernel
    assert report.variables_loaded == len(model.variables)
    # Each distinct slice is read once, then copied to the devices holding it.
    expected_bytes = sum(
        sum(
            {
                tuple((i.start, i.stop) for i in shard.index): shard.data.nbytes
                for shard in v.value.addressable_shards
            }.values()
        )
        for v in model.variables
    )
    assert report.bytes_read == expected_bytes


def test_keras_archive_with_optimizer_state_loads_bit_exact(tmp_path):
    source = seeded_mlp(seed=2)
    source.compile(optimizer="adam", loss="mse")
    x, y = zoo.mlp_batch()
    source.fit(x, y, batch_size=8, epochs=2, verbose=0)
    path = str(tmp_path / "mlp.keras")
    source.save(path)
    model = sharded_mlp(mlp_plan())
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)

    load_weights_sharded(model, path)

    assert_same_values(model, source)
    for target, expected in zip(model.optimizer.variables, source.optimizer.variables):
        assert np.array_equal(np.asarray(target.value), np.asarray(expected.value))
    assert int(model.optimizer.iterations) == 2
    assert os.listdir(tmp_path) == ["mlp.keras"]  # extracted copy removed


def test_keras_sharded_weights_load_and_a_missing_shard_is_named(tmp_path):
    source = seeded_mlp(seed=10)
    index = str(tmp_path / "mlp.weights.json")
    source.save_weights(index, max_shard_size=0.0001)  # 100 kB per file
    shard_files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".h5"))
    assert len(shard_files) >= 2
    model = sharded_mlp(mlp_plan())

    report = load_weights_sharded(model, index)

    assert_same_values(model, source)
    assert len(report.files) == len(shard_files)
    os.remove(tmp_path / shard_files[-1])
    with pytest.raises(CheckpointError, match=shard_files[-1]):
        load_weights_sharded(model, index)


def test_safetensors_by_variable_path_by_h5_key_and_by_name_map(tmp_path):
    source = seeded_mlp(seed=3)
    by_path = {v.path: np.asarray(v.value) for v in source.variables}
    by_key = {k: np.asarray(v.value) for k, v in keras_h5_keys(source).items()}
    renamed = {f"model.{p.replace('/', '.')}": a for p, a in by_path.items()}
    save_file(by_path, str(tmp_path / "paths.safetensors"))
    save_file(by_key, str(tmp_path / "keys.safetensors"))
    save_file(renamed, str(tmp_path / "renamed.safetensors"))
    plan = mlp_plan()

    for name, name_map in [
        ("paths", None),
        ("keys", None),
        ("renamed", lambda key: key.removeprefix("model.").replace(".", "/")),
    ]:
        model = sharded_mlp(plan)
        log = ReadLog()
        load_weights_sharded(
            model, str(tmp_path / f"{name}.safetensors"), name_map, on_read=log
        )
        assert_same_values(model, source)
        key_of = {
            "paths": {p: p for p in by_path},
            "keys": {v.path: k for k, v in keras_h5_keys(model).items()},
            "renamed": {p: f"model.{p.replace('/', '.')}" for p in by_path},
        }[name]
        assert_reads_are_device_slices(model, log, key_of)


def test_loads_into_auto_shard_model_before_planning(tmp_path):
    source = seeded_mlp(seed=4)
    path = str(tmp_path / "mlp.weights.h5")
    source.save_weights(path)
    distribution = AutoShardDistribution(device_mesh=MESH)
    with distribution.scope():
        model = zoo.build_mlp_block()

    load_weights_sharded(model, path)

    assert_same_values(model, source)
    distribution.prepare(model, zoo.mlp_batch()[0])
    assert_same_values(model, source)
    kernel = model.get_layer("up").kernel.value
    assert kernel.addressable_shards[0].data.nbytes < kernel.nbytes


def test_kerashub_preset_builds_from_config_and_loads_sharded(tmp_path):
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(5)
    config = dict(zoo.SMALL_GPT2_CONFIG, num_layers=2)
    with names_replayed_after():
        source = keras_hub.models.GPT2Backbone(**config)
    preset = str(tmp_path / "preset")
    source.save_to_preset(preset)
    assert {"config.json", "model.weights.h5"} <= set(os.listdir(preset))
    rules = {
        r".*/(query|key|value)/kernel": (None, "model", None),
        r".*/attention_output/kernel": ("model", None, None),
        r".*/feedforward_intermediate_dense/kernel": (None, "model"),
        r".*/feedforward_output_dense/kernel": ("model", None),
        r"token_embedding/embeddings": ("model", None),
    }
    plan = plan_from_rules(source.variables, MESH, rules, "batch")
    log = ReadLog()

    model, report = load_preset_sharded(preset, PlanDistribution(plan), on_read=log)

    assert_same_values(model, source)
    key_of = {v.path: k for k, v in keras_h5_keys(model).items()}
    assert_reads_are_device_slices(model, log, key_of)
    embedding = model.get_layer("token_embedding").embeddings.value
    assert report.max_read_bytes == embedding.nbytes // 4


def test_preset_with_split_safetensors_loads_and_a_missing_file_is_named(tmp_path):
    source = seeded_mlp(seed=9)
    preset = tmp_path / "preset"
    preset.mkdir()
    config = keras.saving.serialize_keras_object(source)
    (preset / "config.json").write_text(json.dumps(config))
    arrays = {v.path: np.asarray(v.value) for v in source.variables}
    first = {k: v for k, v in arrays.items() if k.startswith(("up", "norm"))}
    second = {k: v for k, v in arrays.items() if k not in first}
    save_file(first, str(preset / "model-00001-of-00002.safetensors"))
    save_file(second, str(preset / "model-00002-of-00002.safetensors"))
    plan = mlp_plan()

    model, report = load_preset_sharded(preset, PlanDistribution(plan))

    assert_same_values(model, source)
    assert len(report.files) == 2
    os.remove(preset / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=r"variables not in the files.*down/"):
        load_preset_sharded(preset, PlanDistribution(plan))


def test_bfloat16_weights_load_bit_exact(tmp_path):
    def build():
        return keras.Sequential(
            [keras.Input((16,)), keras.layers.Dense(32, dtype="bfloat16", name="d")]
        )

    with names_replayed_after():
        source = build()
    path = str(tmp_path / "bf16.weights.h5")
    source.save_weights(path)
    plan = plan_from_rules(
        source.variables, MESH, {".*d/kernel": (None, "model")}, None
    )
    with PlanDistribution(plan).scope():
        model = build()

    load_weights_sharded(model, path)

    assert model.get_layer("d").kernel.dtype == "bfloat16"
    assert_same_values(model, source)


# ------------------------------------------------------------------ failures
def test_truncated_h5_is_an_error_naming_file_and_dataset(tmp_path):
    path = str(tmp_path / "mlp.weights.h5")
    seeded_mlp(seed=6).save_weights(path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 4096)
    model = sharded_mlp(mlp_plan())
    before = [np.asarray(v.value) for v in model.variables]

    with pytest.raises(CheckpointError) as error:
        load_weights_sharded(model, path)

    assert path in str(error.value)
    assert "truncated" in str(error.value) or "corrupted" in str(error.value)
    for variable, value in zip(model.variables, before):
        assert np.array_equal(np.asarray(variable.value), value), variable.path


def test_garbage_files_are_errors_naming_the_file(tmp_path):
    model = sharded_mlp(mlp_plan())
    for name in ["bad.weights.h5", "bad.safetensors", "bad.keras"]:
        path = str(tmp_path / name)
        with open(path, "wb") as f:
            f.write(os.urandom(4096))
        with pytest.raises(CheckpointError, match=path):
            load_weights_sharded(model, path)


def test_shape_mismatch_names_tensor_and_variable(tmp_path):
    path = str(tmp_path / "wide.weights.h5")
    zoo.build_mlp_block(hidden=32).save_weights(path)
    model = sharded_mlp(mlp_plan())

    with pytest.raises(CheckpointError) as error:
        load_weights_sharded(model, path)

    message = str(error.value)
    assert path in message and "shape (32," in message
    assert "'norm/gamma'" in message or "'up/kernel'" in message


def test_dtype_mismatch_is_an_error_not_a_silent_cast(tmp_path):
    source = seeded_mlp(seed=7)
    arrays = {v.path: np.asarray(v.value) for v in source.variables}
    arrays["up/kernel"] = arrays["up/kernel"].astype("float16")
    path = str(tmp_path / "half.safetensors")
    save_file(arrays, path)
    model = sharded_mlp(mlp_plan())

    with pytest.raises(CheckpointError, match=r"'up/kernel'.*dtype float16.*float32"):
        load_weights_sharded(model, path)


def test_missing_tensor_and_other_model_are_errors_naming_them(tmp_path):
    source = seeded_mlp(seed=8)
    arrays = {v.path: np.asarray(v.value) for v in source.variables}
    del arrays["down/bias"]
    missing = str(tmp_path / "missing.safetensors")
    save_file(arrays, missing)
    model = sharded_mlp(mlp_plan())
    with pytest.raises(CheckpointError, match=r"down/bias"):
        load_weights_sharded(model, missing)

    other = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4)])
    other_path = str(tmp_path / "other.weights.h5")
    other.save_weights(other_path)
    with pytest.raises(CheckpointError, match="another model"):
        load_weights_sharded(model, other_path)
