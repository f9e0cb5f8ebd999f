"""`AutoShardDistribution` plans the model of the trainer call that asks,
and only that model: two distributions in one process, interleaved, each
with its own plan, each matching its single-device run, and Keras itself
left as it was."""

import keras
import numpy as np

import keras_autoshard as ka
from keras_autoshard.building import names_replayed_after
from keras_autoshard.testing import zoo
from tests.parity import PARITY_SEED, assert_close

MESH_2x4 = ka.MeshSpec((2, 4), ("batch", "model"))
MESH_8x1 = ka.MeshSpec((8, 1), ("batch", "model"))
TRAINER_METHODS = ("fit", "predict", "predict_on_batch", "evaluate", "_symbolic_build")


def _trainer_methods() -> dict:
    """Each trainer method of every class `keras.Model` inherits from (the
    JAX trainer and Keras's base trainer, whatever Keras names them)."""
    return {
        (cls, name): vars(cls)[name]
        for cls in keras.Model.__mro__
        for name in TRAINER_METHODS
        if name in vars(cls)
    }


def _adam():
    return keras.optimizers.Adam(1e-3, epsilon=1e-6)


def _pair(name, distribution):
    build, batch = zoo.ZOO[name]
    x = batch()
    y = zoo.random_targets(build, x)
    keras.utils.set_random_seed(PARITY_SEED)
    with names_replayed_after():
        reference = build()
    with distribution.scope():
        sharded = build()
    for target, source in zip(sharded.variables, reference.variables):
        target.assign(np.asarray(source.value))
    reference.compile(optimizer=_adam(), loss="mse")
    with distribution.scope():
        sharded.compile(optimizer=_adam(), loss="mse")
    return reference, sharded, x, y


def test_two_models_under_two_distributions_interleaved_each_match_one_device():
    trainer_methods = _trainer_methods()
    assert {name for _, name in trainer_methods} == set(TRAINER_METHODS)
    dist_a = ka.AutoShardDistribution(device_mesh=MESH_2x4)
    dist_b = ka.AutoShardDistribution(device_mesh=MESH_8x1)
    ref_a, model_a, x_a, y_a = _pair("gpt2", dist_a)
    ref_b, model_b, x_b, y_b = _pair("mlp", dist_b)

    for step in range(3):
        with dist_a.scope():
            loss_a = model_a.train_on_batch(x_a, y_a)
        with dist_b.scope():
            loss_b = model_b.fit(x_b, y_b, batch_size=len(x_b), verbose=0)
        assert_close(loss_a, ref_a.train_on_batch(x_a, y_a), f"gpt2 loss {step}")
        expected_b = ref_b.fit(x_b, y_b, batch_size=len(x_b), verbose=0)
        assert_close(
            loss_b.history["loss"], expected_b.history["loss"], f"mlp loss {step}"
        )

    # Each distribution planned its own model on its own mesh.
    assert dist_a.plan.mesh == MESH_2x4 and dist_b.plan.mesh == MESH_8x1
    assert dist_a.plan.get(model_a.trainable_variables[0].path) is not None
    assert dist_b.plan.get(model_b.trainable_variables[0].path) is not None
    assert dist_a.plan.batch_axis == "batch" and dist_b.plan.batch_axis == "batch"
    for model, reference in ((model_a, ref_a), (model_b, ref_b)):
        # Biases that start at zero are judged against the model's weight
        # scale, as in tests/parity.py.
        weight_scale = max(
            float(np.max(np.abs(v.value))) for v in reference.trainable_variables
        )
        for variable, expected in zip(
            model.trainable_variables, reference.trainable_variables
        ):
            assert_close(
                variable.value, expected.value, variable.path, scale_floor=weight_scale
            )
    # Predictions after training, through each distribution's scope.
    with dist_a.scope():
        predicted_a = model_a.predict(x_a, batch_size=8, verbose=0)
    assert_close(predicted_a, ref_a.predict(x_a, batch_size=8, verbose=0), "predict")
    # Keras's classes are untouched before, during and after.
    assert _trainer_methods() == trainer_methods


def test_a_model_outside_the_scope_is_left_alone_while_another_is_planned():
    dist = ka.AutoShardDistribution(device_mesh=MESH_2x4)
    build, batch = zoo.ZOO["mlp"]
    x = batch()
    y = zoo.random_targets(build, x)
    outside = build()
    outside.compile(optimizer=_adam(), loss="mse")
    with dist.scope():
        inside = build()
        inside.compile(optimizer=_adam(), loss="mse")
        inside.fit(x, y, batch_size=len(x), verbose=0)
    outside.fit(x, y, batch_size=len(x), verbose=0)
    assert dist.is_planned
    for variable in outside.trainable_variables:
        assert len(variable.value.sharding.device_set) == 1, variable.path
    assert any(
        len(v.value.sharding.device_set) == 8 for v in inside.trainable_variables
    )
