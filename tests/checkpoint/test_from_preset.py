"""`keras_autoshard.from_preset`: a KerasHub task built from a local preset
under a distribution, its backbone read slice by slice onto the devices."""

import os

import keras
import keras_hub
import numpy as np

import keras_autoshard as ka


def _tiny_gpt2():
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=256,
        num_layers=2,
        num_heads=4,
        hidden_dim=64,
        intermediate_dim=128,
        max_sequence_length=16,
    )


def test_from_preset_builds_the_task_sharded_and_loads_every_weight(tmp_path):
    keras.utils.set_random_seed(3)
    task = keras_hub.models.GPT2CausalLM(backbone=_tiny_gpt2(), preprocessor=None)
    preset = os.fspath(tmp_path / "preset")
    task.save_to_preset(preset)

    dist = ka.AutoShardDistribution(device_mesh=ka.MeshSpec((2, 4), ("batch", "model")))
    loaded, report = ka.from_preset(keras_hub.models.GPT2CausalLM, preset, dist)

    assert isinstance(loaded, keras_hub.models.GPT2CausalLM)
    assert report.variables_loaded == len(task.backbone.weights)
    for target, source in zip(loaded.backbone.weights, task.backbone.weights):
        assert target.path == source.path
        np.testing.assert_array_equal(
            np.asarray(target.value), np.asarray(source.value)
        )
    # Created under the distribution: the large variables are spread out.
    table = loaded.backbone.get_layer("token_embedding").embeddings
    assert len(table.value.sharding.device_set) == 8
    # And the model trains sharded from there (planned on its first batch).
    tokens = np.random.default_rng(0).integers(0, 256, (8, 16)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    with dist.scope():
        loaded.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        history = loaded.fit(x, tokens, batch_size=8, verbose=0)
    assert dist.is_planned and np.isfinite(history.history["loss"]).all()
