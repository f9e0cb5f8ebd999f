"""The batch is split over data axes wherever a dim carries it, and a plan is
always found without rules or budget: models written here, each the
smallest case of a pattern real models have."""

import warnings

import keras
import numpy as np
import pytest

import keras_autoshard as ka
from tests.parity import check_parity

MESH_2x4 = ka.MeshSpec((2, 4), ("batch", "model"))
MESH_8x1 = ka.MeshSpec((8, 1), ("batch", "model"))
MESH_4x2 = ka.MeshSpec((4, 2), ("batch", "model"))


class TokenRouter(keras.layers.Layer):
    """Flattens (b, s, h) to (b·s, h) tokens, projects, and restores (b, s, .),
    as every MoE router does."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.project = keras.layers.Dense(units, name="router_project")

    def call(self, x):
        _, seq, hidden = x.shape
        tokens = keras.ops.reshape(x, (-1, hidden))
        routed = self.project(tokens)
        return keras.ops.reshape(routed, (-1, seq, routed.shape[-1]))


def token_flattening_model():
    inputs = keras.Input((16, 32), name="features")
    hidden = keras.layers.Dense(64, name="up")(inputs)
    hidden = TokenRouter(32, name="router")(hidden)
    return keras.Model(inputs, keras.layers.Dense(8, name="head")(hidden))


def two_tower_model():
    """Image and text towers meeting in one (B, B) similarity matrix, as in
    contrastive (CLIP/SigLIP) models: two batch dims in one tensor."""
    images = keras.Input((24,), name="images")
    texts = keras.Input((12,), name="texts")
    image_embedding = keras.layers.Dense(16, name="image_tower")(images)
    text_embedding = keras.layers.Dense(16, name="text_tower")(texts)
    logits = keras.ops.matmul(image_embedding, keras.ops.transpose(text_embedding))
    return keras.Model([images, texts], logits)


def _features(rows=8):
    return np.random.default_rng(0).standard_normal((rows, 16, 32)).astype("float32")


@pytest.mark.parametrize("mesh", [MESH_2x4, MESH_8x1], ids=str)
def test_token_flattening_splits_the_batch_and_trains_like_one_device(mesh):
    x = _features()
    y = np.random.default_rng(1).standard_normal((8, 16, 8)).astype("float32")
    dist = ka.AutoShardDistribution(device_mesh=mesh)
    check_parity(token_flattening_model, dist, x, y, steps=2)
    assert dist.plan.batch_axis == "batch"
    assert not [n for n in dist.plan.notes if n.startswith("The batch of")]


def test_two_batch_dims_in_one_tensor_split_one_and_keep_the_other_whole():
    rng = np.random.default_rng(0)
    x = [
        rng.standard_normal((8, 24)).astype("float32"),
        rng.standard_normal((8, 12)).astype("float32"),
    ]
    y = rng.standard_normal((8, 8)).astype("float32")
    dist = ka.AutoShardDistribution(device_mesh=MESH_2x4)
    check_parity(two_tower_model, dist, x, y, steps=2)
    # One of the two inputs' batch is split, the other is kept whole and
    # the notes name it.
    assert dist.plan.batch_axis == "batch"
    whole = [n for n in dist.plan.notes if n.startswith("The batch of")]
    assert len(whole) == 1 and "8 rows" in whole[0], dist.plan.notes


def test_a_batch_that_does_not_divide_the_data_axis_is_not_cut_over_it_with_a_note():
    # Issue 33: the batch no data axis cuts may go over a model axis; 6 rows
    # divide 'model' (size 2), so the plan cuts them there rather than
    # repeat the step on both of its devices.
    plan = ka.plan(token_flattening_model, MESH_4x2, sample_input=_features(6))
    assert plan.batch_axis == "model"
    (note,) = [n for n in plan.notes if n.startswith("The batch of")]
    assert "6 rows do not divide 'batch' (size 4)" in note
    assert "multiple of 4" in note


def test_auto_shard_distribution_warns_once_when_the_batch_stays_whole():
    dist = ka.AutoShardDistribution(device_mesh=MESH_4x2)
    with dist.scope():
        model = token_flattening_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.prepare(model, _features(6))
        dist.prepare(model, _features(6))
    batch_warnings = [w for w in caught if "The batch of" in str(w.message)]
    assert len(batch_warnings) == 1
    assert "do not divide 'batch'" in str(batch_warnings[0].message)


def _dense_250():
    inputs = keras.Input((32,), name="features")
    return keras.Model(inputs, keras.layers.Dense(250, name="dense")(inputs))


def test_a_rule_that_cuts_a_dim_the_axis_does_not_divide_names_rule_dim_and_size():
    x = np.zeros((8, 32), "float32")
    with pytest.raises(ka.errors.PlanError) as raised:
        ka.plan(
            _dense_250,
            MESH_2x4,
            sample_input=x,
            rules={"dense/kernel": (None, "model")},
        )
    message = str(raised.value)
    for fact in ("'dense/kernel'", "dim 1", "size 250", "'model' (size 4)"):
        assert fact in message, message


@pytest.mark.parametrize(
    "budget, expected", [("1GiB", 2**30), ("80GB", 80 * 10**9), (4096, 4096)]
)
def test_memory_budget_takes_bytes_or_size_strings(budget, expected):
    from keras_autoshard.plans.units import byte_size

    assert byte_size(budget) == expected
    dist = ka.AutoShardDistribution(device_mesh=MESH_2x4, memory_budget=budget)
    assert dist._memory_budget == expected


@pytest.mark.parametrize("budget", ["1 lightyear", -5, [1], True])
def test_a_memory_budget_that_is_not_a_size_is_a_clear_error(budget):
    with pytest.raises(ka.errors.PlanError, match="A size must"):
        ka.plan(
            token_flattening_model,
            MESH_2x4,
            sample_input=_features(),
            memory_budget=budget,
        )


def test_a_one_kib_budget_string_is_a_budget_error_not_a_type_error():
    with pytest.raises(
        ka.errors.PlanError, match="No plan fits the per-device budget of"
    ):
        ka.plan(
            token_flattening_model,
            MESH_2x4,
            sample_input=_features(),
            memory_budget="1KiB",
        )


def _mlp():
    inputs = keras.Input((16,), name="features")
    hidden = keras.layers.Dense(32, activation="relu", name="up")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="down")(hidden))


def _mlp_data(rows):
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((rows, 16)).astype("float32"),
        rng.standard_normal((rows, 4)).astype("float32"),
    )


@pytest.mark.parametrize("planned_before", [False, True], ids=["first", "later"])
def test_a_partial_last_batch_is_a_clear_error_and_the_model_still_trains(
    planned_before,
):
    x, y = _mlp_data(16)
    dist = ka.AutoShardDistribution(device_mesh=MESH_4x2)
    with dist.scope():
        model = _mlp()
        model.compile(optimizer="adam", loss="mse")
        if planned_before:
            model.fit(x, y, batch_size=8, verbose=0)
        with pytest.raises(ka.errors.BatchSizeError) as raised:
            model.fit(x[:10], y[:10], batch_size=8, verbose=0)
        message = str(raised.value)
        for fact in ("the last batch has 2 rows", "'batch' (size 4)", "drop"):
            assert fact in message, message
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert dist.plan.batch_axis == "batch"


def test_steps_per_epoch_that_stops_before_the_partial_last_batch_trains():
    # The fix the error above names: stop before the last batch.
    x, y = _mlp_data(10)
    dist = ka.AutoShardDistribution(device_mesh=MESH_4x2)
    with dist.scope():
        model = _mlp()
        model.compile(optimizer="adam", loss="mse")
        history = model.fit(x, y, batch_size=8, steps_per_epoch=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def test_several_steps_per_execution_plan_on_one_batch_and_train():
    # keras 3.16 distributes the batches of one execution stacked together.
    x, y = _mlp_data(32)
    dist = ka.AutoShardDistribution(device_mesh=MESH_4x2)
    with dist.scope():
        model = _mlp()
        model.compile(optimizer="adam", loss="mse", steps_per_execution=2)
        history = model.fit(x, y, batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert dist.plan.batch_axis == "batch"
    assert dist.plan.variable("up/kernel").shape == (16, 32)


def test_a_first_batch_that_does_not_divide_the_data_axis_is_a_clear_error():
    x, y = _mlp_data(12)
    dist = ka.AutoShardDistribution(device_mesh=MESH_4x2)
    with dist.scope():
        model = _mlp()
        model.compile(optimizer="adam", loss="mse")
        model.fit(x[:8], y[:8], batch_size=8, verbose=0)
        with pytest.raises(ka.errors.BatchSizeError, match="this batch has 6 rows"):
            model.fit(x, y, batch_size=6, verbose=0)
        model.fit(x[:8], y[:8], batch_size=4, verbose=0)


class ClassToken(keras.layers.Layer):
    """A learned class token tiled to the batch and put before the patches,
    as ViT, DeiT and DINO backbones do."""

    def build(self, input_shape):
        self.token = self.add_weight(shape=(1, 1, input_shape[-1]), name="token")

    def call(self, patches):
        tokens = keras.ops.tile(self.token, (keras.ops.shape(patches)[0], 1, 1))
        return keras.ops.concatenate([tokens, patches], axis=1)


def class_token_model():
    inputs = keras.Input((16, 32), name="patches")
    hidden = keras.layers.Dense(32, name="embed")(inputs)
    hidden = ClassToken(name="class_token")(hidden)
    return keras.Model(inputs, keras.layers.Dense(8, name="head")(hidden[:, 0]))


@pytest.mark.parametrize("mesh", [MESH_2x4, MESH_8x1], ids=str)
def test_a_class_token_tiled_to_the_batch_keeps_data_parallelism(mesh):
    x = _features()
    y = np.random.default_rng(1).standard_normal((8, 8)).astype("float32")
    dist = ka.AutoShardDistribution(device_mesh=mesh)
    check_parity(class_token_model, dist, x, y, steps=2)
    assert dist.plan.batch_axis == "batch", dist.plan.notes


class FourierMixing(keras.layers.Layer):
    """FNet's token mixing: the real part of a 2-D FFT over (sequence,
    hidden), computed independently for every row of the batch."""

    def call(self, x):
        real, _ = keras.ops.fft2((x, keras.ops.zeros_like(x)))
        return real


def fourier_model():
    inputs = keras.Input((16, 32), name="features")
    hidden = keras.layers.Dense(32, name="embed")(inputs)
    hidden = FourierMixing(name="mixing")(hidden)
    return keras.Model(inputs, keras.layers.Dense(8, name="head")(hidden))


def test_an_fft_keeps_the_batch_on_the_data_axis_and_matches_one_device():
    x = _features()
    y = np.random.default_rng(1).standard_normal((8, 16, 8)).astype("float32")
    dist = ka.AutoShardDistribution(device_mesh=MESH_8x1)
    check_parity(fourier_model, dist, x, y, steps=2)
    assert dist.plan.batch_axis == "batch", dist.plan.notes
    assert not any("Unknown primitive 'fft'" in n for n in dist.plan.notes)


class ApproximateTopK(keras.layers.Layer):
    """Uses a primitive the planner has no rule for (`approx_top_k`)."""

    def call(self, x):
        import jax

        return jax.lax.approx_max_k(x, 4)[0]


def test_a_primitive_with_no_rule_keeps_the_batch_whole_and_the_note_names_it():
    def build():
        inputs = keras.Input((16,), name="features")
        hidden = keras.layers.Dense(16, name="dense")(inputs)
        return keras.Model(inputs, ApproximateTopK(name="top_scores")(hidden))

    plan = ka.plan(build, MESH_8x1, sample_input=np.ones((8, 16), "float32"))
    assert plan.batch_axis is None
    (note,) = [n for n in plan.notes if n.startswith("The batch of")]
    assert "unknown primitive 'approx_top_k' in layer 'top_scores'" in note


class Regroup(keras.layers.Layer):
    """(b, s, 8) → (b·s·2, 4) → Dense → (b, s, 8): a reshape that is neither a
    pure split nor a pure merge, its batch in the major factor of both sides
    (as in gated delta rules, Qwen3.5)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mix = keras.layers.Dense(4, name="mix")

    def call(self, x):
        batch_seq = x.shape[1]
        pieces = keras.ops.reshape(x, (-1, 4))
        return keras.ops.reshape(self.mix(pieces), (-1, batch_seq, 8))


def regroup_model():
    inputs = keras.Input((16, 32), name="features")
    hidden = keras.layers.Dense(8, name="down")(inputs)
    hidden = Regroup(name="regroup")(hidden)
    return keras.Model(inputs, keras.layers.Dense(8, name="head")(hidden))


class Windows(keras.layers.Layer):
    """Swin's window partition and reverse: (b, H, W, C) → (b·n, 2·2, C),
    a Dense per window, then (b, n, 4, C) + a per-window bias (only reshapes
    and an add touch the b·n dim there) and back to (b, H, W, C)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mix = keras.layers.Dense(16, name="window_mix")

    def build(self, input_shape):
        _, height, width, channels = input_shape
        self.windows = (height // 2) * (width // 2)
        self.bias = self.add_weight(
            shape=(self.windows, 4, channels), initializer="ones", name="bias"
        )

    def call(self, x):
        _, height, width, channels = x.shape
        x = keras.ops.reshape(x, (-1, height // 2, 2, width // 2, 2, channels))
        x = keras.ops.transpose(x, (0, 1, 3, 2, 4, 5))
        x = self.mix(keras.ops.reshape(x, (-1, 4, channels)))
        x = keras.ops.reshape(x, (-1, self.windows, 4, channels)) + self.bias
        x = keras.ops.reshape(x, (-1, height // 2, width // 2, 2, 2, channels))
        x = keras.ops.transpose(x, (0, 1, 3, 2, 4, 5))
        return keras.ops.reshape(x, (-1, height, width, channels))


def window_model():
    inputs = keras.Input((4, 4, 16), name="image")
    hidden = Windows(name="windows")(keras.layers.Dense(16, name="embed")(inputs))
    return keras.Model(inputs, keras.layers.Dense(8, name="head")(hidden))


@pytest.mark.parametrize("mesh", [MESH_2x4, MESH_8x1], ids=str)
@pytest.mark.parametrize(
    "build, x_shape, y_shape",
    [
        (regroup_model, (8, 16, 32), (8, 16, 8)),
        (window_model, (8, 4, 4, 16), (8, 4, 4, 8)),
    ],
    ids=["regroup", "windows"],
)
def test_reshapes_that_regroup_the_batch_keep_it_split(build, x_shape, y_shape, mesh):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype("float32")
    y = rng.standard_normal(y_shape).astype("float32")
    dist = ka.AutoShardDistribution(device_mesh=mesh)
    check_parity(build, dist, x, y, steps=2)
    assert dist.plan.batch_axis == "batch"
    assert not [n for n in dist.plan.notes if n.startswith("The batch of")]


class LinspaceFromInput(keras.layers.Layer):
    """Turns an input into a Python length: not traceable by jax.jit."""

    def call(self, x, steps):
        return x * keras.ops.sum(keras.ops.linspace(0.0, 1.0, steps[0]))


class Scheduled(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4, name="dense")
        self.schedule = LinspaceFromInput(name="schedule")

    def call(self, inputs):
        features, steps = inputs
        return self.schedule(self.dense(features), steps)


def test_a_model_jax_cannot_trace_is_a_clear_error_naming_layer_and_line():
    batch = (np.ones((8, 4), "float32"), np.full((8,), 3, "int32"))
    model = Scheduled()
    model(batch)  # eagerly the length is a number: the model builds and runs
    with pytest.raises(ka.errors.ModelNotTraceableError) as error:
        ka.plan(model, MESH_2x4, sample_input=batch)
    message = str(error.value)
    assert "tracing stopped in layer 'schedule' (LinspaceFromInput)" in message
    assert "test_batch_split.py:" in message and "(call)" in message
    assert "ConcretizationTypeError" in message
