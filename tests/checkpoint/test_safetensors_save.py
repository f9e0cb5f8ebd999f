"""`save_safetensors` writes a sharded model's weights as one safetensors file
(keys: Keras weights-file keys), one tensor at a time: the safetensors
library reads it back bit for bit, and `load_weights_sharded` loads it into
another sharded model on another mesh bit for bit. The torch side is in
`tests/checkpoint/test_torch_weights.py`."""

import json
import struct

import keras
import numpy as np
import pytest
from safetensors.numpy import load_file

from keras_autoshard import MeshSpec, load_weights_sharded, save_safetensors
from keras_autoshard.errors import CheckpointError
from keras_autoshard.io.keras_weights_layout import keras_h5_keys
from tests.checkpoint.test_checkpoint_loading import (
    assert_same_values,
    mlp_plan,
    seeded_mlp,
    sharded_mlp,
)


def test_a_sharded_model_round_trips_through_safetensors_bit_exactly(tmp_path):
    source = sharded_mlp(mlp_plan())
    for variable in source.variables:
        noise = np.random.default_rng(3).standard_normal(variable.shape)
        variable.assign(noise.astype(variable.dtype))
    path = tmp_path / "mlp.safetensors"
    save_safetensors(source, path, metadata={"run": "a"})

    stored = load_file(str(path))  # the reference reader
    keys = keras_h5_keys(source)
    assert sorted(stored) == sorted(keys)
    for key, variable in keys.items():
        assert np.array_equal(stored[key], np.asarray(variable.value)), key
    header_size = struct.unpack("<Q", path.read_bytes()[:8])[0]
    header = json.loads(path.read_bytes()[8 : 8 + header_size])
    assert header["__metadata__"] == {"run": "a"}

    other_mesh = MeshSpec((1, 8), ("batch", "model"))
    target = sharded_mlp(mlp_plan(other_mesh))
    load_weights_sharded(target, path)
    assert_same_values(target, source)
    assert not (tmp_path / "mlp.safetensors.partial").exists()


def test_bfloat16_weights_keep_their_bits(tmp_path):
    path = tmp_path / "bf16.safetensors"
    bf16 = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(4, dtype="bfloat16", name="d")]
    )
    bf16.layers[0].kernel.assign(np.random.default_rng(0).standard_normal((8, 4)))
    save_safetensors(bf16, path)
    stored = load_file(str(path))
    kernel = np.asarray(bf16.layers[0].kernel.value)
    assert stored["layers/dense/vars/0"].dtype == kernel.dtype
    assert np.array_equal(stored["layers/dense/vars/0"], kernel)


def test_a_path_without_the_suffix_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"\.safetensors"):
        save_safetensors(seeded_mlp(0), tmp_path / "weights.bin")
